"""The search's lean simulator (`simulate.finish_times`) equals the
schedule simulator on the lowered orders, for every schedule."""

import random
import zlib

import pytest

from meshplan.schedules import add_comm, compute_actions, placement_of, simulate
from meshplan.schedules.simulate import finish_times
from meshplan.search.space import schedule_takes

CASES = [(s, pp, vpp, m) for s, vpps in (("1f1b", (1,)), ("gpipe", (1,)),
                                        ("interleaved", (2, 3)), ("zb1p", (1, 2)),
                                        ("zbv", (2,)))
         for pp in (1, 2, 3, 4) for vpp in vpps for m in (1, 4, 9)
         if schedule_takes(s, pp, vpp, m)]


def costs(seed, n):
    rng = random.Random(seed)
    cost = {(v, k): rng.uniform(0.1, 2.0) for v in range(n) for k in "fiw"}
    comm = {(a, b): rng.uniform(0.0, 0.5) for a in range(n) for b in range(n)}
    return cost, comm


def reference(schedule, pp, vpp, m, cost, comm):
    where = placement_of(schedule, pp, vpp)
    orders = {r: compute_actions(schedule, pp, vpp, m, r) for r in range(pp)}
    res = simulate(add_comm(orders, pp, placement=where), pp,
                   cost_f=lambda v: cost[(v, "f")], cost_i=lambda v: cost[(v, "i")],
                   cost_w=lambda v: cost[(v, "w")],
                   cost_comm=lambda kind, a, b: comm[(a, b)], placement=where)
    return orders, where, res


@pytest.mark.parametrize("schedule,pp,vpp,m", CASES)
def test_equals_simulate(schedule, pp, vpp, m):
    cost, comm = costs(zlib.crc32(f"{schedule}{pp}{vpp}{m}".encode()), pp * vpp)
    orders, where, res = reference(schedule, pp, vpp, m, cost, comm)
    finish, busy = finish_times(orders, where, cost, comm)
    for r in range(pp):
        assert finish[r] == pytest.approx(res.finish[r], rel=1e-12, abs=1e-12)
        assert busy[r] == pytest.approx(res.busy[r], rel=1e-12, abs=1e-12)


def test_a_planted_bug_fails():
    """Dropping the transfer time (a bug the property above must catch)."""
    cost, comm = costs(7, 4)
    orders, where, res = reference("interleaved", 2, 2, 4, cost, comm)
    finish, _ = finish_times(orders, where, cost, {k: 0.0 for k in comm})
    assert any(abs(finish[r] - res.finish[r]) > 1e-6 for r in range(2))


def test_a_deadlock_is_none():
    from meshplan.schedules.action import Action, ActionType

    where = placement_of("1f1b", 2, 1)
    # rank 0 waits for stage 1's input gradient before sending stage 1 its forward
    orders = {0: [Action(0, ActionType.B, 0), Action(0, ActionType.F, 0)],
              1: [Action(1, ActionType.F, 0), Action(1, ActionType.B, 0)]}
    cost = {(v, k): 1.0 for v in range(2) for k in "fiw"}
    assert finish_times(orders, where, cost, {}) is None
