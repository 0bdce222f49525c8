"""Launch paths and faults: two torchrun node launches, a killed rank, a
world size or plan directory that does not match."""

import json
import os
import subprocess
import sys
import time

import pytest

from meshplan.driver.plan import zoo_strategy
from meshplan.driver.reference import eager_train
from meshplan.driver.run import run
from meshplan.errors import RuntimeFault
from meshplan.ir.mesh import Mesh
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime import launch
from meshplan.runtime.launch import free_port
from tests.cli.test_cli import assert_user_error
from tests.faults.kill import rank_entry_killing


def _eager(model, steps, gbs, m):
    import torch

    from meshplan.autodiff import OptimizerConfig

    cfg = model_config(model, "tiny")
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, gbs, seed=s) for s in range(steps)]
    return eager_train(module, batches, m, OptimizerConfig.default("sgd")).losses


@pytest.mark.slow
def test_two_torchrun_node_launches_match_eager(tmp_path):
    """2 nodes x 4 devices, dp=2 tp=2 pp=2, as two torchrun launches on 127.0.0.1."""
    port = free_port()
    args = ["-m", "meshplan", "run", "--model", "gpt", "--nodes", "2", "--devices-per-node",
            "4", "--tp", "2", "--pp", "2", "--global-batch-size", "8", "--micro-batch-size",
            "2", "--steps", "10", "--json", "--trace", str(tmp_path / "trace.json")]
    env = {**os.environ, "MESHPLAN_CACHE_DIR": str(tmp_path / "cache")}
    nodes = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "4", "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", str(port), *args]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    outs = [p.communicate(timeout=600) for p in nodes]
    assert all(p.returncode == 0 for p in nodes), outs[0][1][-2000:] + outs[1][1][-2000:]
    r = json.loads(outs[0][0].strip().splitlines()[-1])
    ref = _eager("gpt", 10, 8, 2)
    assert len(r["ranks"]) == 8
    assert max(abs(a - b) for a, b in zip(r["losses"], ref)) <= 1e-4
    # rank 0 merged the last step of all 8 ranks (gathered, no shared files)
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == set(range(8))
    assert r["trace"]["bubble_ratio"] >= 0


def test_a_killed_rank_ends_the_job_naming_it(monkeypatch):
    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, pp=2, global_batch_size=8, micro_batch_size=2)
    monkeypatch.setattr(launch, "spawn_entry", rank_entry_killing(1, after_steps=2))
    t0 = time.monotonic()
    with pytest.raises(RuntimeFault) as e:
        run("gpt", "tiny", Mesh(1, 2), s, steps=4)  # rank 1 dies as its 3rd step starts
    assert time.monotonic() - t0 < 60
    msg = str(e.value)
    assert "rank 1 died" in msg and "in action" in msg and "\n" not in msg


def test_world_size_mismatch_under_torchrun_is_one_line():
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    p = subprocess.run([sys.executable, "-m", "meshplan", "run", "--devices-per-node", "2",
                        "--tp", "2", "--steps", "1"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert_user_error(p, "torchrun started 3 ranks but the strategy needs 1x2 = 2")


def test_bad_plan_dir_fails_before_any_collective(tmp_path):
    (tmp_path / "job.json").write_text("{not json")
    p = subprocess.run([sys.executable, "-m", "meshplan", "check", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert_user_error(p, "job.json")


def test_run_compiled_plans_and_reject_a_mismatched_world(tmp_path):
    from meshplan.driver.compile import compile_job
    from meshplan.driver.plan import plan_model

    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, tp=2, global_batch_size=8, micro_batch_size=8)
    job = plan_model("gpt", "tiny", Mesh(1, 2), s).job
    compile_job(job, tmp_path / "plans", workers=1, use_cache=False)
    r = run("gpt", "tiny", Mesh(1, 2), s, steps=2, plan_dir=str(tmp_path / "plans"))
    assert max(abs(a - b) for a, b in zip(r["losses"], _eager("gpt", 2, 8, 1))) <= 1e-5
    with pytest.raises(RuntimeFault, match="holds plans for 2 ranks but 4"):
        run("gpt", "tiny", Mesh(1, 4), s, steps=1, plan_dir=str(tmp_path / "plans"))


def test_a_ranks_own_error_is_one_line_and_keeps_its_traceback_for_debug(tmp_path):
    """A rank's report (`fail_R.json`) becomes one line; its traceback rides
    along as the error's note, which `--debug` prints (`meshplan --debug`
    re-raises) and the one line leaves out."""
    from types import SimpleNamespace

    report = {"rank": 1, "action": "STEP", "time": 1.0, "error": "KeyError: 7",
              "traceback": "Traceback (most recent call last):\n  File \"<meshplan step>\"\n"}
    (tmp_path / "fail_1.json").write_text(json.dumps(report))
    procs = [SimpleNamespace(exitcode=0, is_alive=lambda: False),
             SimpleNamespace(exitcode=1, is_alive=lambda: False)]
    with pytest.raises(RuntimeFault) as e:
        launch._raise_if_failed(procs, tmp_path, None, b"")
    assert str(e.value) == "rank 1 failed in action STEP: KeyError: 7; the other ranks were stopped"
    assert e.value.__notes__ == ["rank 1's traceback:\n" + report["traceback"]]
