"""The discrete-event simulator: grid runs deadlock-free, hand-made deadlocks are caught."""

import importlib
import json
import math
import re

import pytest

from meshplan.errors import ScheduleError
from meshplan.schedules import chrome_trace, simulate
from meshplan.schedules.action import ActionType
from meshplan.schedules.grid import ascii_timeline

from ._util import GRID, grid_id, lowered, parse_lists, run


@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_grid_simulates_without_deadlock(case):
    res = run(*case)
    assert res.ok and res.deadlock is None, res.deadlock
    name, pp, vpp, m = case
    assert all(b == pytest.approx(2 * vpp * m) for b in res.busy.values())
    assert res.step_time == max(res.finish.values())


def test_receive_before_send_cycle_deadlocks():
    acts = parse_lists({0: "0RECV_B0 0F0 0SEND_F0 0B0",
                        1: "1RECV_F0 1F0 1B0 1SEND_B0"})
    res = simulate(acts, 2)
    assert not res.ok and math.isinf(res.step_time)
    msg = res.deadlock
    assert "stages [0, 1]" in msg
    assert "stage 0 is blocked at step 0 on 0RECV_B0, waiting for 1SEND_B0 on stage 1" in msg
    assert "stage 1 is blocked at step 0 on 1RECV_F0, waiting for 0SEND_F0 on stage 0" in msg
    assert msg.count("<-- ERROR HERE") == 1  # both marks are on step 0's row
    assert "(stage 0: 0RECV_B0; stage 1: 1RECV_F0)" in msg


def test_missing_send_deadlocks():
    acts = parse_lists({0: "0F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"})
    res = simulate(acts, 2)
    assert not res.ok
    assert "0SEND_F0 on stage 0, which stage 0 never runs" in res.deadlock


def test_same_rank_order_deadlock_pp1():
    res = simulate(parse_lists({0: "1F0 0F0 0B0 1B0"}), 1)
    assert not res.ok and "waiting for 0F0 on stage 0 (step 1, not reached)" in res.deadlock


def test_comm_cost_by_hand():
    # rank0 F [0,1], SEND at 1; rank1 RECV done 1.5, F [1.5,2.5], B [2.5,3.5];
    # rank0 RECV_B done 4.0, B [4,5].
    res = run("gpipe", 2, 1, 1, cost_comm=lambda kind, src, dst: 0.5)
    assert res.ok and res.step_time == 5.0
    assert res.finish == {0: 5.0, 1: 3.5}
    assert res.per_stage_bubble == {0: 1.5, 1: 1.5}
    spans = {str(a): (s, e) for a, s, e in res.timeline[1]}
    assert spans["1RECV_F0"] == (0.0, 1.5) and spans["1F0"] == (1.5, 2.5)


def test_comm_cost_gets_transfer_kind():
    seen = set()
    run("gpipe", 2, 1, 1, cost_comm=lambda kind, src, dst: seen.add((kind, src, dst)) or 0.0)
    assert seen == {(ActionType.F, 0, 1), (ActionType.B, 1, 0)}


def test_step_cost():
    acts = lowered("gpipe", 2, 1, 1)
    acts = {r: [*a, *parse_lists({0: "STEP"})[0]] for r, a in acts.items()}
    res = simulate(acts, 2, cost_step=2.0)
    assert res.ok and res.step_time == 6.0 and res.busy == {0: 4.0, 1: 4.0}


def test_chrome_trace():
    res = run("interleaved", 2, 2, 4)
    trace = json.loads(json.dumps(chrome_trace(res)))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == sum(len(v) for v in res.timeline.values())
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    first = next(e for e in events if e["name"] == "0F0")
    assert first["ts"] == 0 and first["dur"] == 1000.0 and first["cat"] == "compute"


def _docstring_diagram(module: str) -> str:
    doc = importlib.import_module(f"meshplan.schedules.{module}").__doc__
    lines = [line[4:] for line in doc.splitlines() if re.match(r"    (time|stage) ", line)]
    return "\n".join(lines)


def _short(a):
    return f"{a.type.value}{a.microbatch}"


@pytest.mark.parametrize("module,name,pp,vpp,m,label", [
    ("gpipe", "gpipe", 4, 1, 4, _short), ("one_f_one_b", "1f1b", 4, 1, 8, _short),
    ("interleaved", "interleaved", 2, 2, 4, str)])
def test_docstring_diagrams_are_simulated(module, name, pp, vpp, m, label):
    assert _docstring_diagram(module) == ascii_timeline(run(name, pp, vpp, m).timeline, label)


def test_split_costs_by_hand():
    # zb1p pp=2 m=1, F=1 I=2 W=3: rank0 F [0,1]; rank1 F [1,2], I [2,4], W [4,7];
    # rank0 I [4,6], W [6,9]. The W's fill nothing here: one micro-batch.
    res = run("zb1p", 2, 1, 1, cost_i=lambda s: 2.0, cost_w=lambda s: 3.0)
    spans = {str(a): (s, e) for r in res.timeline.values() for a, s, e in r}
    assert spans["1I0"] == (2.0, 4.0) and spans["1W0"] == (4.0, 7.0)
    assert spans["0I0"] == (4.0, 6.0) and spans["0W0"] == (6.0, 9.0)
    assert res.step_time == 9.0 and res.busy == {0: 6.0, 1: 6.0}


def test_b_costs_i_plus_w():
    costs = dict(cost_i=lambda s: 2.0, cost_w=lambda s: 3.0)
    res = run("gpipe", 2, 1, 1, **costs)
    spans = {str(a): (s, e) for r in res.timeline.values() for a, s, e in r}
    assert spans["1B0"] == (2.0, 7.0)


def test_i_and_w_default_to_half_of_b():
    res = run("zb1p", 2, 1, 2, cost_b=lambda s: 4.0)
    assert all(e - s == 2.0 for r in res.timeline.values() for a, s, e in r
               if a.type in (ActionType.I, ActionType.W))


def test_w_waits_for_i_same_rank():
    res = simulate(parse_lists({0: "0F0 0W0 0I0"}), 1)
    assert not res.ok and "waiting for 0I0 on stage 0 (step 2, not reached)" in res.deadlock
    assert res.stuck == {0: 1}


def test_bad_cost_arguments():
    with pytest.raises(ScheduleError, match="give cost_i and cost_w together"):
        run("zb1p", 2, 1, 2, cost_i=lambda s: 1.0)
    with pytest.raises(ScheduleError, match="not both"):
        run("zb1p", 2, 1, 2, cost_b=lambda s: 1.0, cost_i=lambda s: 1.0, cost_w=lambda s: 1.0)
