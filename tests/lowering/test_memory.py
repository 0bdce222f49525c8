"""The memory layout is safe: no two buffer instances share bytes while both are live,
judged in EXECUTION order (the rank's actions expanded into tasks), not op order."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshplan.ir import Phase
from meshplan.lowering.memory import _first_fit
from meshplan.lowering.rankplan import RankPlan, TaskKind
from meshplan.schedules.action import ActionType
from tests.lowering.jobs import job_of, plans_of

_STATE = ("param", "buffer", "grad", "optimizer")

intervals = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 10), st.integers(1, 64)),
                     max_size=40)


@given(intervals)
def test_first_fit_never_overlaps_live_intervals(raw):
    ivs = [(k, s, s + n, size) for k, (s, n, size) in enumerate(raw)]
    offsets, extent = _first_fit(ivs)
    assert set(offsets) == {k for k, *_ in ivs}
    assert extent == max((offsets[k] + z for k, _, _, z in ivs), default=0)
    for k, s, e, z in ivs:
        assert offsets[k] >= 0
        for k2, s2, e2, z2 in ivs:
            if k < k2 and s < e2 and s2 < e:  # live together
                assert offsets[k] + z <= offsets[k2] or offsets[k2] + z2 <= offsets[k]
    # never worse than giving every interval its own bytes, never below the live peak
    assert extent <= sum(z for *_, z in ivs)
    peak = max((sum(z for _, s, e, z in ivs if s <= t < e) for t in range(60)), default=0)
    assert extent >= peak


def test_first_fit_reuses_freed_memory():
    offsets, extent = _first_fit([(0, 0, 2, 100), (1, 2, 4, 100), (2, 1, 3, 10)])
    assert extent == 110 and offsets[0] == offsets[1]


def execution(plan: RankPlan, pp: int) -> list[tuple[int, object, int]]:
    """(time, task, micro-batch) in the order the rank runs them."""
    groups = defaultdict(list)
    for t in plan.tasks:
        if t.phase is Phase.OPTIMIZER:
            groups["STEP"].append(t)
            continue
        kind = {TaskKind.SEND: "SEND_", TaskKind.RECV: "RECV_"}.get(t.kind, "")
        groups[(kind + ("F" if t.phase is Phase.FORWARD else "B"), t.chunk)].append(t)
    out = []
    for a in plan.actions:
        key = "STEP" if a.type is ActionType.STEP else (a.type.value, a.virtual_stage // pp)
        out += [(len(out) + i, t, a.microbatch) for i, t in enumerate(groups.get(key, ()))]
    assert len(out) >= len(plan.tasks)  # every task is run by some action
    return out


def lifetimes(plan: RankPlan, pp: int) -> dict[int, list[tuple[int, int, int]]]:
    """buffer id -> [(first, last + 1, micro-batch)] over its instances."""
    span: dict = {}
    for time, t, mb in execution(plan, pp):
        for bid in t.inputs + t.outputs:
            if bid >= 0:
                lo, hi = span.get((bid, mb), (time, time))
                span[(bid, mb)] = (min(lo, time), max(hi, time))
    out = defaultdict(list)
    for (bid, mb), (lo, hi) in span.items():
        out[bid].append((lo, hi + 1, mb))
    return out


def max_live(instances) -> int:
    events = sorted([(s, 1) for s, _, _ in instances] + [(e, -1) for _, e, _ in instances])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name", ["gpt_2x4", "gpt_1f1b", "gpt_gpipe", "gpt_pp1",
                                  "gpt_interleaved", "bert_2x4",
                                  "resnet_1x4", "gpt_uneven"])
def test_memory_plan_is_safe_in_execution_order(name):
    job, plans = job_of(name), plans_of(name)
    updates = {u.value for u in job.graph.updates}
    for r, plan in plans.items():
        life = lifetimes(plan, job.strategy.pp)
        bufs = {b.id: b for b in plan.buffers}
        for bid, inst in life.items():
            b = bufs[bid]
            if b.category not in _STATE and b.value not in updates:
                assert max_live(inst) <= b.copies, (
                    f"rank {r}: {job.graph.values[b.value].name or b.value} has "
                    f"{max_live(inst)} micro-batches live but {b.copies} copies")
        shared = sorted((blk.arena, blk.offset, blk.offset + blk.size, blk.buffers[0])
                        for blk in plan.memory.blocks
                        if bufs[blk.buffers[0]].category == "activation"
                        and bufs[blk.buffers[0]].copies == 1)
        for i, (c, _, hi, a) in enumerate(shared):
            for c2, lo2, _, b in shared[i + 1:]:
                if c2 != c or lo2 >= hi:
                    break
                for s, e, mb in life[a]:
                    for s2, e2, mb2 in life[b]:
                        assert e <= s2 or e2 <= s, (
                            f"rank {r}: buffers {a:#x} (mb {mb}) and {b:#x} (mb {mb2}) "
                            "share memory while both live")
