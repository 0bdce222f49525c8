"""Measured traces: `run(trace=...)` writes the last step of every rank as
one Chrome trace, with a span for every action of each rank's plan."""

import json

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.run import run
from meshplan.ir.mesh import Mesh
from meshplan.lowering.lower import lower
from meshplan.models import model_config
from meshplan.schedules.trace import Span, Track, bubble, chrome_events


def assert_trace_covers_plans(trace: dict, plans: dict) -> None:
    """One process track per rank; every action of a rank's plan is a span of it."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in plans}
    for r, plan in plans.items():
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == r]
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
        have = {e["name"] for e in spans}
        missing = [str(a) for a in plan.actions if str(a) not in have]
        assert not missing, f"rank {r} lacks spans for {missing[:5]}"
        assert {e["tid"] for e in spans if e["cat"] == "compute"} == {Track.COMPUTE.value}
        assert {e["tid"] for e in spans if e["cat"] == "comm"} == {Track.COMM.value}


def test_bubble_of_two_ranks():
    spans = {0: [Span("0F0", Track.COMPUTE, 0, 1), Span("0SEND_F0", Track.COMM, 1, 1)],
             1: [Span("1RECV_F0", Track.COMM, 0, 1), Span("1F0", Track.COMPUTE, 1, 2)]}
    b = bubble(spans)
    assert b["step_s"] == 2 and b["per_rank_bubble"] == {0: 1.0, 1: 1.0}
    events = chrome_events(spans)["traceEvents"]
    assert [e["args"] for e in events if e["name"] == "1F0"] == [
        {"stage": 1, "microbatch": 0, "type": "F"}]


def test_run_writes_a_measured_trace_of_every_rank(tmp_path):
    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, tp=2, pp=2, global_batch_size=4, micro_batch_size=1)
    mesh = Mesh(1, 4)
    path = tmp_path / "trace.json"
    r = run("gpt", "tiny", mesh, s, steps=2, timeout_s=60, trace=str(path))
    assert r["trace"]["path"] == str(path) and 0 <= r["trace"]["bubble_ratio"] < 100
    trace = json.loads(path.read_text())
    job = plan_model("gpt", "tiny", mesh, s).job
    assert_trace_covers_plans(trace, {k: lower(job, k) for k in range(4)})
    collectives = [e for e in trace["traceEvents"] if e["name"].startswith("all_reduce")]
    assert collectives and all(e["tid"] == Track.COMM.value for e in collectives)


def test_a_zero_bubble_trace_colours_i_and_w_apart(tmp_path):
    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, pp=2, vpp=2, schedule="zb1p", global_batch_size=4,
                     micro_batch_size=1)
    path = tmp_path / "trace.json"
    run("gpt", "tiny", Mesh(1, 2), s, steps=1, timeout_s=60, trace=str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    colour = {e["args"]["type"]: e["cname"] for e in events if e.get("args", {}).get("type")
              in ("F", "I", "W")}
    assert len(set(colour.values())) == 3 and set(colour) == {"F", "I", "W"}
