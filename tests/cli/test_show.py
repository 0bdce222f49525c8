"""`meshplan show`: per-rank summaries, the pipeline grid, a simulated trace."""

import json

from meshplan.driver.compile import compile_job
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.mesh import Mesh
from meshplan.models import model_config
from tests.cli.test_cli import assert_user_error, run


def test_show_summaries_grid_and_trace(tmp_path):
    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, pp=2, vpp=2, global_batch_size=4, micro_batch_size=1)
    compile_job(plan_model("gpt", "tiny", Mesh(1, 2), s).job, tmp_path / "p", workers=1,
                use_cache=False)
    trace = tmp_path / "t.json"
    png = tmp_path / "s.png"
    p = run("show", str(tmp_path / "p"), "--json", "--trace", str(trace), "--png", str(png))
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["png"]["path"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    assert [x["rank"] for x in r["ranks"]] == [0, 1]
    assert all(x["tasks"]["send"] > 0 and x["peers"] for x in r["ranks"])
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert any(e["name"] == "0F0" for e in spans) and any(e["name"] == "3B3" for e in spans)
    table = run("show", str(tmp_path / "p"), "--rank", "1")
    assert table.returncode == 0 and "pipeline grid" in table.stdout and "1F0" in table.stdout
    assert_user_error(run("show", str(tmp_path / "p"), "--rank", "9"), "--rank 9")
