"""Fuzz: random schedule parameters, and random corruptions.

- Any (schedule, pp, vpp, num_microbatches), zero-bubble ones (I/W split,
  their own stage placement) included, either is refused with a
  ScheduleError, or lowers to a schedule that validates and simulates with
  no deadlock.
- A corruption of a valid schedule (drop, duplicate or swap an action,
  change a peer, drop a send) is caught: by `validate` (the per-rank order
  and matching), or by the simulation (a wait cycle across ranks, e.g. a
  blocking RECV swapped before the SEND its peer waits for: validate checks
  each rank's order, the simulator finds deadlocks). Only a swap may leave
  a schedule that is still valid and runs.
- The same corruptions of real rank plans are caught by `check_plans`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from meshplan.errors import ScheduleError
from meshplan.lowering.check import check_plans, simulate_plans
from meshplan.lowering.rankplan import TaskKind
from meshplan.schedules import add_comm, compute_actions, placement_of, simulate, validate
from meshplan.schedules.action import ActionType
from tests.lowering.jobs import job_of, plans_of

COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
FAST = settings(max_examples=60, derandomize=True, **COMMON)
SLOW = settings(max_examples=1500, **COMMON)
MUTATIONS = ("drop", "duplicate", "swap", "peer", "drop_send")
COMM = (ActionType.SEND_F, ActionType.SEND_B, ActionType.RECV_F, ActionType.RECV_B)


@st.composite
def params(draw):
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb1p", "zbv"]))
    pp = draw(st.integers(1, 6))
    if name in ("interleaved", "zb1p"):
        vpp = draw(st.integers(1, 3))
    else:
        vpp = draw(st.sampled_from([1, 2, 2] if name == "zbv" else [1, 1, 2]))
    return name, pp, vpp, draw(st.integers(1, 12))


def lowered(name: str, pp: int, vpp: int, m: int):
    """The lowered schedule, or None when the counts are refused (one line)."""
    try:
        compute = {r: compute_actions(name, pp, vpp, m, r)
                   for r in range(pp)}
        where = placement_of(name, pp, vpp)
    except ScheduleError as e:
        assert "\n" not in str(e)
        return None
    return add_comm(compute, pp, placement=where)


def mutate(acts: list, kind: str, data, stages: int) -> bool:
    """Corrupt `acts` in place; False when this list has nothing to corrupt."""
    comm = [i for i, a in enumerate(acts) if a.type in COMM]
    if kind == "drop":
        del acts[data.draw(st.integers(0, len(acts) - 1))]
    elif kind == "duplicate":
        i = data.draw(st.integers(0, len(acts) - 1))
        acts.insert(i + data.draw(st.integers(0, 1)), acts[i])
    elif kind == "swap":
        if len(acts) < 2:
            return False
        i = data.draw(st.integers(0, len(acts) - 2))
        j = data.draw(st.integers(i + 1, len(acts) - 1))
        acts[i], acts[j] = acts[j], acts[i]
    elif kind == "peer":
        if not comm or stages < 3:
            return False
        i = data.draw(st.sampled_from(comm))
        peer = data.draw(st.sampled_from([s for s in range(stages)
                                          if s not in (acts[i].peer, acts[i].virtual_stage)]))
        acts[i] = replace(acts[i], peer=peer)
    else:
        sends = [i for i in comm if acts[i].type in (ActionType.SEND_F, ActionType.SEND_B)]
        if not sends:
            return False
        del acts[data.draw(st.sampled_from(sends))]
    return True


def schedule_case(p, kind, data) -> None:
    name, pp, vpp, m = p
    acts = lowered(name, pp, vpp, m)
    if acts is None:
        event("refused")
        return
    where = placement_of(name, pp, vpp)
    validate(acts, pp, vpp, m, placement=where)
    assert simulate(acts, pp, placement=where).ok
    rank = data.draw(st.integers(0, pp - 1))
    bad = {r: list(a) for r, a in acts.items()}
    if not mutate(bad[rank], kind, data, pp * vpp):
        return
    try:
        validate(bad, pp, vpp, m, placement=where)
    except ScheduleError as e:
        assert "<-- ERROR HERE" in str(e)
        event(f"{kind}: caught by validate")
        return
    sim = simulate(bad, pp, placement=where)
    if not sim.ok:
        assert "cannot make progress" in sim.deadlock
        event(f"{kind}: caught by simulate")
        return
    assert kind == "swap", f"{kind} of rank {rank} not caught"
    event("swap: still valid")


@pytest.mark.timeout(300)
@FAST
@given(params(), st.sampled_from(MUTATIONS), st.data())
def test_schedules_validate_and_corruptions_are_caught(p, kind, data):
    schedule_case(p, kind, data)


@pytest.mark.slow
@pytest.mark.timeout(900)
@SLOW
@given(params(), st.sampled_from(MUTATIONS), st.data())
def test_schedules_validate_and_corruptions_are_caught_many(p, kind, data):
    schedule_case(p, kind, data)


def plan_case(name: str, kind: str, data) -> None:
    job, plans = job_of(name), plans_of(name)
    stage = data.draw(st.integers(0, job.strategy.pp - 1))
    ranks = job.strategy.placement(stage).ranks
    bad = dict(plans)
    if kind in ("peer", "drop_send"):  # a task of one rank
        r = data.draw(st.sampled_from(ranks))
        tasks = list(plans[r].tasks)
        p2p = [i for i, t in enumerate(tasks) if t.kind in (TaskKind.SEND, TaskKind.RECV)]
        sends = [i for i in p2p if tasks[i].kind is TaskKind.SEND]
        assume(sends)
        if kind == "peer":
            i = data.draw(st.sampled_from(p2p))
            others = [q for q in range(job.mesh.world) if q != tasks[i].peer]
            tasks[i] = replace(tasks[i], peer=data.draw(st.sampled_from(others)))
        else:
            del tasks[data.draw(st.sampled_from(sends))]
        bad[r] = replace(plans[r], tasks=tuple(tasks))
    else:  # the same action change on every rank of the stage
        acts = list(plans[ranks[0]].actions)
        assume(mutate(acts, kind, data, job.strategy.pp * job.strategy.vpp))
        bad.update({r: replace(plans[r], actions=tuple(acts)) for r in ranks})
    res = check_plans(job, bad)
    if res.ok:
        assert kind == "swap" and simulate_plans(job, bad).ok
        event("swap: still valid")
    else:
        event(f"{kind}: caught")


@pytest.mark.timeout(300)
@FAST
@given(st.sampled_from(["gpt_interleaved", "gpt_1f1b"]), st.sampled_from(MUTATIONS), st.data())
def test_corrupted_plans_are_caught(name, kind, data):
    plan_case(name, kind, data)


@pytest.mark.slow
@pytest.mark.timeout(900)
@SLOW
@given(st.sampled_from(["gpt_interleaved", "gpt_1f1b", "gpt_gpipe"]), st.sampled_from(MUTATIONS),
       st.data())
def test_corrupted_plans_are_caught_many(name, kind, data):
    plan_case(name, kind, data)
