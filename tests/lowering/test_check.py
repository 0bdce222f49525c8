"""check_plans proves good plans consistent and names what is wrong with bad ones;
read_dir refuses damaged plan directories with one line."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from meshplan.cli.main import main
from meshplan.errors import PlanError
from meshplan.lowering.check import check_plans
from meshplan.lowering.files import (
    JOB_FILE,
    open_class,
    open_head,
    plan_files,
    plan_name,
    read_dir,
    write_job,
    write_plan,
)
from meshplan.lowering.rankplan import TaskKind
from meshplan.schedules.action import ActionType
from tests.lowering.jobs import job_of, plans_of

GOOD = ["gpt_2x4", "bert_2x4", "resnet_1x4", "gpt_gpipe", "gpt_pp1", "gpt_1f1b",
        "gpt_uneven", "gpt_interleaved"]


@pytest.mark.parametrize("name", GOOD)
def test_good_plans_pass(name):
    job, plans = job_of(name), plans_of(name)
    res = check_plans(job, plans)
    assert res.ok and res.errors == []
    assert res.predicted_step_s > 0
    if job.strategy.pp > 1:
        assert res.bubble_ratio > 0
    else:
        assert res.bubble_ratio == pytest.approx(0, abs=1e-9)
    assert sorted(res.ranks) == list(range(job.mesh.world))
    for r, v in res.ranks.items():
        assert v.planned_peak_bytes == plans[r].memory.peak_bytes() > 0
        assert v.tasks == len(plans[r].tasks) and v.stage == plans[r].stage
    js = res.to_json()
    assert set(js) == {"ok", "partial", "missing", "skipped", "errors", "bubble_ratio",
                       "predicted_step_s", "ranks"}
    assert (js["partial"], js["missing"], js["skipped"]) == (False, "", [])


# ---- corrupted plans ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt():
    return job_of("gpt_2x4"), plans_of("gpt_2x4")


def errors_of(job, plans) -> list[str]:
    res = check_plans(job, plans)  # never raises for a bad plan
    assert not res.ok and res.errors and res.predicted_step_s is None
    return res.errors


def without(seq, i):
    return tuple(seq[:i]) + tuple(seq[i + 1:])


def test_a_dropped_recv_task(gpt):
    job, plans = gpt
    p = plans[4]
    i = next(i for i, t in enumerate(p.tasks) if t.kind is TaskKind.RECV)
    (err,) = errors_of(job, plans | {4: replace(p, tasks=without(p.tasks, i))})
    assert "send of op" in err and "to rank 4 has no matching recv there" in err


def test_a_dropped_send_task(gpt):
    job, plans = gpt
    p = plans[0]
    i = next(i for i, t in enumerate(p.tasks) if t.kind is TaskKind.SEND)
    errs = errors_of(job, plans | {0: replace(p, tasks=without(p.tasks, i))})
    assert any("rank 4: recv of op" in e and "has no matching send there" in e for e in errs)


def test_a_send_and_recv_that_disagree_on_the_piece(gpt):
    job, plans = gpt
    p = plans[0]
    i, t = next((i, t) for i, t in enumerate(p.tasks) if t.kind is TaskKind.SEND)
    box = ((t.box[0][0], t.box[0][1] - 1),) + t.box[1:]
    tasks = p.tasks[:i] + (replace(t, box=box),) + p.tasks[i + 1:]
    errs = errors_of(job, plans | {0: replace(p, tasks=tasks)})
    assert any("disagree on the piece" in e for e in errs)


def test_a_task_id_of_another_rank(gpt):
    job, plans = gpt
    p = plans[1]
    tasks = (replace(p.tasks[0], id=plans[0].tasks[0].id),) + p.tasks[1:]
    errs = errors_of(job, plans | {1: replace(p, tasks=tasks)})
    assert any("rank 1: task 0x0" in e and "decodes to rank 0" in e for e in errs)
    assert any("1 duplicated task ids" in e and "unique across ranks" in e for e in errs)


@pytest.mark.parametrize("which", ["param", "send input"])
def test_a_buffer_id_of_another_rank(gpt, which):
    job, plans = gpt
    p = plans[1]
    if which == "param":
        i = 0
    else:  # a buffer a send task reads: the send now points at nothing
        send = next(t for t in p.tasks if t.kind is TaskKind.SEND)
        i = next(i for i, b in enumerate(p.buffers) if b.id == send.inputs[0])
    stolen = plans[0].buffers[0].id
    buffers = p.buffers[:i] + (replace(p.buffers[i], id=stolen),) + p.buffers[i + 1:]
    errs = errors_of(job, plans | {1: replace(p, buffers=buffers)})
    assert any(f"rank 1: buffer {stolen:#x} is not in the rank's id space" in e for e in errs)
    assert any("duplicated buffer/block/chunk ids" in e for e in errs)
    assert any("not among the rank's buffers" in e for e in errs)


def test_a_reordered_collective(gpt):
    job, plans = gpt
    p = plans[0]
    coll = [(i, t) for i, t in enumerate(p.tasks) if t.kind is TaskKind.COLLECTIVE]
    (i, a), (j, b) = next((x, y) for x in coll for y in coll if x[0] < y[0]
                          and (x[1].chunk, x[1].phase, x[1].group)
                          == (y[1].chunk, y[1].phase, y[1].group))
    tasks = list(p.tasks)
    tasks[i], tasks[j] = b, a
    (err,) = errors_of(job, plans | {0: replace(p, tasks=tuple(tasks))})
    assert f"collective order differs in group {list(a.group)}" in err
    assert f"rank 0 runs ({b.op}, 0)" in err and f"rank {a.group[1]} runs ({a.op}, 0)" in err


def test_a_dropped_recv_action(gpt):
    job, plans = gpt
    stage1 = job.strategy.placement(1).ranks
    k = next(k for k, a in enumerate(plans[stage1[0]].actions)
             if a.type is ActionType.RECV_F and a.microbatch == 2)
    bad = {r: replace(plans[r], actions=without(plans[r].actions, k)) for r in stage1}
    err, *more = errors_of(job, plans | bad)  # the schedule proof reports it too
    first = err.splitlines()[0]
    assert "SEND_F2 has no RECV_F of micro-batch 2 on rank" in first
    assert "<-- ERROR HERE" in err and "step" in err.splitlines()[1]


def test_ranks_of_a_stage_with_different_action_lists(gpt):
    job, plans = gpt
    acts = list(plans[5].actions)
    k = next(k for k, a in enumerate(acts) if a.type is ActionType.F)
    acts[k], acts[k + 1] = acts[k + 1], acts[k]
    (err,) = errors_of(job, plans | {5: replace(plans[5], actions=tuple(acts))})
    assert f"ranks 4 and 5 of stage 1 run different action lists (from action {k})" in err
    assert "<-- ERROR HERE (rank 5:" in err


# ---- damaged plan directories --------------------------------------------------------------

@pytest.fixture
def plan_dir(tmp_path, gpt):
    job, plans = gpt
    write_job(tmp_path, job)
    for p in plans.values():
        write_plan(tmp_path, p, job)
    return tmp_path


def one_line_error(out, *phrases) -> str:
    with pytest.raises(PlanError) as e:
        read_dir(out)
    msg = str(e.value)
    assert "\n" not in msg
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


def test_an_intact_directory_reads_back(plan_dir, gpt):
    job, plans = gpt
    job2, plans2 = read_dir(plan_dir)
    assert job2.digest() == job.digest() and plans2 == plans


def test_a_truncated_rank_file(plan_dir):
    path = plan_dir / plan_name(3)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    one_line_error(plan_dir, str(path), "truncated", "recompile")


def test_a_flipped_byte(plan_dir):
    path = plan_dir / plan_name(6)
    data = bytearray(path.read_bytes())
    i = data.index(b'"coord":[') + 9  # a digit of the rank's coordinate
    data[i] = ord("7") if data[i] != ord("7") else ord("8")
    path.write_bytes(bytes(data))
    one_line_error(plan_dir, str(path), "checksum mismatch")


def test_every_single_bit_flip_is_caught(gpt):
    """Over a sample of positions: a flipped bit never yields a plan."""
    head, _, body = plan_files(gpt[1][0], gpt[0])
    for data, read in ((head, open_head), (body, open_class)):
        for i in range(0, len(data), max(1, len(data) // 300)):
            for bit in (0, 3, 5, 7):
                bad = bytearray(data)
                bad[i] ^= 1 << bit
                with pytest.raises(PlanError):
                    read(bytes(bad), "x.plan")


def test_a_job_file_of_another_compile(plan_dir):
    write_job(plan_dir, job_of("bert_2x4"))
    msg = one_line_error(plan_dir, "was lowered from another Job", "recompile")
    assert plan_name(0) in msg


def test_a_missing_rank_file(plan_dir):
    (plan_dir / plan_name(3)).unlink()
    (plan_dir / plan_name(6)).unlink()
    one_line_error(plan_dir, str(plan_dir), "lacks the plans of ranks 3, 6 (world 8)")


def test_check_of_some_ranks_says_it_is_partial(gpt):
    job, plans = gpt  # dp2 tp2 pp2: ranks 0-3 stage 0, 4-7 stage 1
    res = check_plans(job, {r: plans[r] for r in (0, 5)})
    assert res.ok and res.errors == [] and res.partial and res.missing == [1, 2, 3, 4, 6, 7]
    assert res.skipped == ["send/recv with the missing ranks",
                           "collective order on the missing ranks"]
    assert res.predicted_step_s > 0  # each stage has a plan: schedule and simulation run
    js = res.to_json()
    assert (js["partial"], js["missing"]) == (True, "1-4, 6-7")
    one_stage = check_plans(job, {r: plans[r] for r in (0, 1)})
    assert one_stage.ok and one_stage.skipped[-2:] == ["schedule", "simulation"]
    assert one_stage.predicted_step_s is None and one_stage.bubble_ratio is None


def test_a_partial_check_still_reports_what_is_wrong(gpt):
    job, plans = gpt
    p = plans[4]
    i = next(i for i, t in enumerate(p.tasks) if t.kind is TaskKind.RECV and t.peer == 0)
    res = check_plans(job, {0: plans[0], 4: replace(p, tasks=without(p.tasks, i))})
    assert not res.ok and res.partial
    assert any("to rank 4 has no matching recv there" in e for e in res.errors)
    p = plans[0]  # a peer outside the world is wrong, not missing
    i = next(i for i, t in enumerate(p.tasks) if t.kind is TaskKind.SEND)
    tasks = p.tasks[:i] + (replace(p.tasks[i], peer=99),) + p.tasks[i + 1:]
    res = check_plans(job, {0: replace(p, tasks=tasks), 5: plans[5]})
    assert any("to rank 99 has no matching recv there" in e for e in res.errors)


def test_meshplan_check_of_a_partial_directory(plan_dir, capsys):
    for r in (3, 6, 7):
        (plan_dir / plan_name(r)).unlink()
    assert sorted(read_dir(plan_dir, partial=True)[1]) == [0, 1, 2, 4, 5]
    assert main(["check", str(plan_dir)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("PARTIAL: 5 of 8 rank plans; missing ranks 3, 6-7; skipped: send/recv "
                     "with the missing ranks, collective order on the missing ranks")


def test_a_missing_job_file(plan_dir):
    (plan_dir / JOB_FILE).unlink()
    one_line_error(plan_dir, str(plan_dir / JOB_FILE), "does not exist")


def test_a_missing_directory(tmp_path):
    one_line_error(tmp_path / "nope", "does not exist", "meshplan compile")


def test_a_rank_file_holding_another_ranks_plan(plan_dir):
    shutil.copy(plan_dir / plan_name(1), plan_dir / plan_name(2))
    one_line_error(plan_dir, str(plan_dir / plan_name(2)), "holds the plan of rank 1,")


def test_a_rank_beyond_the_world(plan_dir, gpt):
    """Names are padded to 5 digits; rank 100000 has 6 and is still read as itself."""
    write_plan(plan_dir, replace(gpt[1][0], rank=100000), gpt[0])
    assert (plan_dir / "rank_100000.plan").is_file()
    one_line_error(plan_dir, "rank_100000.plan", "outside world 8")


def test_stray_files_are_ignored(plan_dir, gpt):
    for name in ("rank_1.plan", "rank_00001.plan.bak", "notes.txt", ".rank_00001.plan.x.tmp"):
        (plan_dir / name).write_text("junk")
    assert read_dir(plan_dir)[1] == gpt[1]
