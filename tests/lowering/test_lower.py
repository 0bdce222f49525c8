"""lower(job, rank): a pure function of (Job, rank) giving only that rank's work."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from meshplan.driver.compile import compile_job
from meshplan.ir import Phase
from meshplan.ir.sbp import Shard
from meshplan.lowering.files import JOB_FILE, class_name, plan_files, plan_name, read_dir
from meshplan.lowering.ids import TaskId
from meshplan.lowering.rankplan import TaskKind
from meshplan.schedules.action import ActionType
from tests.lowering.jobs import job_of, plans_of

PEAK_KEYS = ("param", "grad", "optimizer", "activation", "temp")


# ---- central == separate, byte for byte -------------------------------------------------

@pytest.mark.parametrize("name", ["gpt_2x4", "gpt_uneven"])
def test_worker_processes_write_the_central_bytes(name, tmp_path):
    job, plans = job_of(name), plans_of(name)
    stats = compile_job(job, tmp_path, workers=2, use_cache=False)
    assert stats["workers"] == 2 and sorted(stats["ranks"]) == list(range(job.mesh.world))
    assert (tmp_path / JOB_FILE).read_bytes() == job.to_bytes()
    assert read_dir(tmp_path)[1] == plans
    for r, plan in plans.items():
        head, klass, body = plan_files(plan, job)
        assert (tmp_path / plan_name(r)).read_bytes() == head, f"rank {r}"
        assert (tmp_path / class_name(klass)).read_bytes() == body, f"rank {r}"
        assert stats["ranks"][r]["tasks"] == len(plan.tasks)
        assert stats["ranks"][r]["planned_peak_bytes"] == plan.memory.peak_bytes()


_LOWER_ONE = textwrap.dedent("""
    import hashlib, sys
    from pathlib import Path
    from meshplan.ir.job import Job
    from meshplan.lowering.files import plan_files
    from meshplan.lowering.lower import lower
    job = Job.from_bytes(Path(sys.argv[1]).read_bytes(), sys.argv[1])
    head, _, body = plan_files(lower(job, int(sys.argv[2])), job)
    print(hashlib.sha256(head + body).hexdigest())
""")


def test_a_fresh_process_per_rank_gives_the_central_bytes(tmp_path):
    job, plans = job_of("gpt_2x4"), plans_of("gpt_2x4")
    path = tmp_path / "job.bin"
    path.write_bytes(job.to_bytes())
    ranks = (0, 5)  # one per stage
    procs = {r: subprocess.Popen(
        [sys.executable, "-c", _LOWER_ONE, str(path), str(r)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env=os.environ | {"PYTHONHASHSEED": str(17 + r)}) for r in ranks}  # differing hash seeds
    for r, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        head, _, body = plan_files(plans[r], job)
        assert out.strip() == hashlib.sha256(head + body).hexdigest(), f"rank {r}"


def test_the_uneven_case_is_uneven():
    """vocab 130 over tp=4: ranks of one stage hold different local shapes."""
    job, plans = job_of("gpt_uneven"), plans_of("gpt_uneven")
    for stage in range(job.strategy.pp):
        ranks = job.strategy.placement(stage).ranks
        by_value: dict[int, set] = {}
        for r in ranks:
            for b in plans[r].buffers:
                by_value.setdefault(b.value, set()).add(b.shape)
        uneven = {v for v, shapes in by_value.items() if len(shapes) > 1}
        assert uneven, f"stage {stage} is even"
    wte = next(v.id for v in job.graph.values if v.name == "wte.weight")
    rows = [next(b.shape for b in plans[r].buffers if b.value == wte)[0]
            for r in job.strategy.placement(0).ranks]
    assert rows == [33, 33, 32, 32]


# ---- a rank's tasks are its own -----------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt_2x4", "gpt_uneven", "bert_2x4"])
def test_tasks_belong_to_their_rank_and_stage(name):
    job, plans = job_of(name), plans_of(name)
    for r, plan in plans.items():
        assert plan.stage == job.strategy.stage_of_rank(r)
        assert len({t.id for t in plan.tasks}) == len(plan.tasks)
        for t in plan.tasks:
            assert TaskId.unpack(t.id).rank == r
            op = job.graph.ops[t.op]
            if op.kind == "meshplan.transfer":
                src = dict(op.kwargs)["src_stage"]
                mine = src if t.kind is TaskKind.SEND else job.stage[op.id]
                assert t.kind in (TaskKind.SEND, TaskKind.RECV) and mine == plan.stage
                assert job.strategy.stage_of_rank(t.peer) == (
                    job.stage[op.id] if t.kind is TaskKind.SEND else src)
            else:
                assert job.stage[op.id] == plan.stage, (r, t)
                assert t.kind not in (TaskKind.SEND, TaskKind.RECV)
            if t.group:
                assert r in t.group and set(t.group) <= set(job.strategy.placement(
                    plan.stage).ranks)


@pytest.mark.parametrize("name", ["gpt_2x4", "gpt_gpipe", "gpt_interleaved", "resnet_1x4"])
def test_peer_task_ids_are_derived_consistently(name):
    """Each rank computes its peer's task id without seeing the peer's plan;
    the ids must name the peer's matching task, of the same op, phase and box."""
    plans = plans_of(name)
    tasks = {t.id: t for p in plans.values() for t in p.tasks}
    pairs = 0
    for r, plan in plans.items():
        for t in plan.tasks:
            if t.kind in (TaskKind.SEND, TaskKind.RECV):
                other = tasks[t.peer_task]
                assert TaskId.unpack(t.peer_task).rank == t.peer and other.peer == r
                assert other.peer_task == t.id and other.kind is not t.kind
                assert (other.op, other.phase, other.box) == (t.op, t.phase, t.box)
                pairs += 1
    assert pairs > 0 and pairs % 2 == 0


def test_every_stage_op_is_lowered_once_per_rank():
    job, plans = job_of("gpt_2x4"), plans_of("gpt_2x4")
    for plan in plans.values():
        want = {op.id for op in job.graph.ops
                if op.kind != "meshplan.transfer" and job.stage[op.id] == plan.stage}
        got = Counter(t.op for t in plan.tasks if t.kind not in (TaskKind.SEND, TaskKind.RECV))
        assert set(got) == want and set(got.values()) == {1}


def test_task_count_does_not_depend_on_dp():
    counts = {}
    for dp in (1, 2, 4):
        job = job_of(f"gpt_dp{dp}")
        assert job.mesh.world == 4 * dp and job.strategy.num_microbatches == 4
        counts[dp] = Counter(t.kind for t in plans_of_rank0(f"gpt_dp{dp}").tasks)
    assert counts[1][TaskKind.GRAD_REDUCE] == 0
    assert counts[2][TaskKind.GRAD_REDUCE] > 0
    assert counts[2] == counts[4]
    without = {dp: c - Counter({TaskKind.GRAD_REDUCE: c[TaskKind.GRAD_REDUCE]})
               for dp, c in counts.items()}
    assert without[1] == without[2] == without[4]


def plans_of_rank0(name: str):
    from meshplan.lowering.lower import lower
    return lower(job_of(name), 0)


# ---- buffers -------------------------------------------------------------------------------

def _split(size: int, parts: int, k: int) -> int:
    return size // parts + (1 if k < size % parts else 0)


def expected_local_shape(shape, sbp, grid, coord) -> tuple[int, ...]:
    out = list(shape)
    for axis, s in enumerate(sbp):
        if isinstance(s, Shard):
            out[s.dim] = _split(out[s.dim], grid[axis], coord[axis])
    return tuple(out)


@pytest.mark.parametrize("name", ["gpt_2x4", "gpt_uneven"])
def test_buffer_shapes_are_the_logical_shape_split_by_sbp(name):
    job, plans = job_of(name), plans_of(name)
    for r, plan in plans.items():
        grid = job.strategy.placement(plan.stage).grid
        for b in plan.buffers:
            v = job.graph.values[b.value]
            assert b.shape == expected_local_shape(v.meta.shape, job.sbp[b.value], grid,
                                                   plan.coord), (r, v.name)
            assert b.dtype == v.meta.dtype
            n = 1
            for d in b.shape:
                n *= d
            assert b.nbytes == n * b.dtype.itemsize
            if not any(isinstance(s, Shard) for s in job.sbp[b.value]):
                assert b.shape == v.meta.shape  # R and P hold the whole tensor


def test_colwise_weight_is_split_by_rows():
    job, plans = job_of("gpt_2x4"), plans_of("gpt_2x4")
    qkv = next(v for v in job.graph.values if v.name == "blocks.0.attn.qkv.weight")
    assert qkv.meta.shape == (192, 64)
    for r in job.strategy.placement(0).ranks:
        (b,) = [b for b in plans[r].buffers if b.value == qkv.id]
        assert b.shape == (96, 64) and b.category == "param" and b.copies == 1


def inflight(actions, pp: int) -> dict[int, int]:
    """Most micro-batches of each chunk between their F and their B at once."""
    live: Counter = Counter()
    peak: Counter = Counter()
    for a in actions:
        if a.type is ActionType.F:
            chunk = a.virtual_stage // pp
            live[chunk] += 1
            peak[chunk] = max(peak[chunk], live[chunk])
        elif a.type is ActionType.B:
            live[a.virtual_stage // pp] -= 1
    return dict(peak)


def saved_for_backward(plan):
    """Activation buffers made by a forward task and read by a backward one."""
    phase = {t.id: (t.phase, t.chunk) for t in plan.tasks}
    for b in plan.buffers:
        made = [phase[t] for t in b.producers]
        if (b.category == "activation" and made and made[0][0] is Phase.FORWARD
                and any(phase[t][0] is Phase.BACKWARD for t in b.consumers)):
            yield b, made[0][1]


@pytest.mark.parametrize("name, want", [("gpt_1f1b", {0: {0: 2}, 1: {0: 1}}),
                                        ("gpt_2x4", None)])
def test_saved_activations_have_one_copy_per_microbatch_in_flight(name, want):
    job, plans = job_of(name), plans_of(name)
    pp = job.strategy.pp
    for r, plan in plans.items():
        live = inflight(plan.actions, pp)
        if want is not None:
            assert live == want[plan.stage]
        saved = list(saved_for_backward(plan))
        assert saved
        for b, chunk in saved:
            assert b.copies == live[chunk], (r, job.graph.values[b.value].name)


# ---- memory --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt_2x4", "gpt_1f1b", "gpt_uneven", "bert_2x4",
                                  "resnet_1x4"])
def test_peak_is_the_sum_of_its_categories(name):
    for plan in plans_of(name).values():
        peak = dict(plan.memory.peak)
        assert tuple(peak) == PEAK_KEYS + ("total",)
        assert peak["total"] == sum(peak[k] for k in PEAK_KEYS) == plan.memory.peak_bytes()
        assert peak["param"] > 0 and peak["grad"] > 0 and peak["activation"] > 0
        assert all(v >= 0 for v in peak.values())
        sizes = {name: size for _, name, size in plan.memory.arenas}
        assert sizes["state"] == peak["param"] + peak["grad"] + peak["optimizer"]
        assert sizes["activations"] == peak["activation"]


def test_more_microbatches_in_flight_need_more_activation_memory():
    plans = plans_of("gpt_1f1b")
    act = {p.stage: dict(p.memory.peak)["activation"] for p in plans.values()}
    assert act[0] > act[1]


@pytest.mark.parametrize("name", ["gpt_2x4", "gpt_1f1b", "bert_2x4", "resnet_1x4"])
def test_blocks_never_overlap_while_both_are_live(name):
    """State and saved blocks are disjoint; transient blocks share memory only
    when their task-order lifetimes are disjoint."""
    job, plans = job_of(name), plans_of(name)
    updates = {u.value for u in job.graph.updates}
    for r, plan in plans.items():
        index = {t.id: i for i, t in enumerate(plan.tasks)}
        bufs = {b.id: b for b in plan.buffers}
        arena_size = {cid: size for cid, _, size in plan.memory.arenas}
        placed = Counter(i for blk in plan.memory.blocks for i in blk.buffers)
        assert set(placed.values()) == {1}
        assert set(placed) == {b.id for b in plan.buffers if b.value not in updates}
        spans = []
        for blk in plan.memory.blocks:
            assert 0 <= blk.offset and blk.offset + blk.size <= arena_size[blk.arena]
            (bid,) = blk.buffers
            b = bufs[bid]
            assert blk.size == b.nbytes * b.copies
            uses = [index[t] for t in b.producers + b.consumers]
            transient = b.category == "activation" and b.copies == 1 and uses
            life = (min(uses), max(uses) + 1) if transient else (0, len(plan.tasks) + 1)
            spans.append((blk.arena, blk.offset, blk.offset + blk.size, life, bid))
        spans.sort()
        for i, (c, _, hi, life, bid) in enumerate(spans):
            for c2, lo2, _, life2, bid2 in spans[i + 1:]:
                if c2 != c or lo2 >= hi:
                    break
                assert life[1] <= life2[0] or life2[1] <= life[0], (
                    f"rank {r}: buffers {bid:#x} and {bid2:#x} share memory while both live")
