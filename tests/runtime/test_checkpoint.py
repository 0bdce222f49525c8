"""Checkpoints: resume gives the uninterrupted run's losses; a checkpoint
saved in one layout loads into another; an incomplete one is refused."""

import shutil

import pytest

from meshplan.driver.plan import zoo_strategy
from meshplan.driver.run import run
from meshplan.errors import RuntimeFault
from meshplan.ir.mesh import Mesh
from meshplan.models import model_config


def _s(model="gpt", **f):
    f.setdefault("global_batch_size", 8)
    f.setdefault("micro_batch_size", 8 // (f.get("dp", 1) * (2 if f.get("pp", 1) > 1 else 1)))
    return zoo_strategy(model, model_config(model, "tiny"), **f)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_resume_equals_uninterrupted(tmp_path, optimizer):
    s = _s(tp=2)
    full = run("gpt", "tiny", Mesh(1, 2), s, steps=6, optimizer=optimizer)
    run("gpt", "tiny", Mesh(1, 2), s, steps=3, optimizer=optimizer, save_dir=str(tmp_path))
    rest = run("gpt", "tiny", Mesh(1, 2), s, steps=6, optimizer=optimizer,
               save_dir=str(tmp_path / "again"), resume=False)
    resumed = run("gpt", "tiny", Mesh(1, 2), s, steps=6, optimizer=optimizer,
                  save_dir=str(tmp_path), resume=True)
    assert resumed["first_step"] == 3 and len(resumed["losses"]) == 3
    assert resumed["losses"] == full["losses"][3:]
    assert rest["losses"] == full["losses"]


def test_resume_continues_the_lr_schedule_and_the_clipping(tmp_path):
    """The schedule's position (optim@step) is state, checkpointed: a resume
    that started the schedule over would warm up again and part at step 3."""
    from meshplan.autodiff import OptimizerConfig
    from meshplan.ir.lr_schedule import LrSchedule

    opt = OptimizerConfig.of("adamw", max_grad_norm=1.0,
                             lr_schedule=LrSchedule("cosine", warmup_steps=2, decay_steps=4))
    s = _s(tp=2)
    full = run("gpt", "tiny", Mesh(1, 2), s, steps=6, optimizer=opt)
    run("gpt", "tiny", Mesh(1, 2), s, steps=3, optimizer=opt, save_dir=str(tmp_path))
    resumed = run("gpt", "tiny", Mesh(1, 2), s, steps=6, optimizer=opt,
                  save_dir=str(tmp_path), resume=True)
    assert resumed["first_step"] == 3
    assert resumed["losses"] == full["losses"][3:]
    assert resumed["grad_norms"] == full["grad_norms"][3:]


@pytest.mark.slow
def test_fp16_resume_keeps_the_loss_scale(tmp_path):
    """Started at 2**24 the scale halves on overflowing steps across the
    checkpoint; a resume that forgot it would skip different steps."""
    s = _s(pp=2, precision="fp16", initial_loss_scale=2.0 ** 24)
    full = run("gpt", "tiny", Mesh(1, 2), s, steps=8)
    run("gpt", "tiny", Mesh(1, 2), s, steps=4, save_dir=str(tmp_path))
    resumed = run("gpt", "tiny", Mesh(1, 2), s, steps=8, save_dir=str(tmp_path), resume=True)
    assert resumed["losses"] == full["losses"][4:]


@pytest.mark.parametrize("saved, loaded", [
    ((dict(tp=2), (1, 2)), (dict(), (1, 1))),
    ((dict(pp=2), (1, 2)), (dict(), (1, 1))),
    ((dict(), (1, 1)), (dict(tp=2, pp=2), (1, 4))),
])
def test_reshard_across_layouts(tmp_path, saved, loaded):
    (f1, m1), (f2, m2) = saved, loaded
    full = run("gpt", "tiny", Mesh(*m1), _s(**f1), steps=4, optimizer="adamw")
    run("gpt", "tiny", Mesh(*m1), _s(**f1), steps=2, optimizer="adamw", save_dir=str(tmp_path))
    other = run("gpt", "tiny", Mesh(*m2), _s(**f2), steps=4, optimizer="adamw",
                save_dir=str(tmp_path), resume=True)
    assert max(abs(a - b) for a, b in zip(other["losses"], full["losses"][2:])) <= 1e-5


def test_incomplete_checkpoint_is_refused(tmp_path):
    s = _s(tp=2)
    run("gpt", "tiny", Mesh(1, 2), s, steps=1, save_dir=str(tmp_path))
    (tmp_path / "COMPLETE").unlink()
    with pytest.raises(RuntimeFault, match="incomplete"):
        run("gpt", "tiny", Mesh(1, 2), s, steps=2, save_dir=str(tmp_path), resume=True)


@pytest.mark.slow
def test_tied_checkpoint_from_pp2_resumes_at_pp1_and_tp2(tmp_path):
    """The tied weight has a copy on each stage at pp=2; the checkpoint holds
    it once, and loads into one rank and into a tp=2 split."""
    tie = dict(tie_embeddings=True)

    def s(**f):
        f.setdefault("global_batch_size", 8)
        f.setdefault("micro_batch_size", 4 if f.get("pp", 1) > 1 else 8)
        return zoo_strategy("gpt", model_config("gpt", "tiny", **tie), **f)

    full = run("gpt", "tiny", Mesh(1, 2), s(pp=2), steps=4, optimizer="adamw", **tie)
    run("gpt", "tiny", Mesh(1, 2), s(pp=2), steps=2, optimizer="adamw",
        save_dir=str(tmp_path / "pp2"), **tie)
    for f, world in ((dict(), 1), (dict(tp=2), 2)):
        here = tmp_path / f"to{world}"  # a resumed run saves again: each gets its own copy
        shutil.copytree(tmp_path / "pp2", here)
        other = run("gpt", "tiny", Mesh(1, world), s(**f), steps=4, optimizer="adamw",
                    save_dir=str(here), resume=True, **tie)
        assert other["first_step"] == 2
        assert max(abs(a - b) for a, b in zip(other["losses"], full["losses"][2:])) <= 1e-5


def _one_rank(micro_batch_size: int = 8):
    """gpt tiny on one rank (no processes): its Job, executor and state."""
    from meshplan.driver.plan import plan_model
    from meshplan.lowering.lower import lower
    from meshplan.models import build_model
    from meshplan.runtime.rank_executor import RankExecutor

    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, global_batch_size=8, micro_batch_size=micro_batch_size)
    job = plan_model("gpt", "tiny", Mesh(1, 1), s).job
    ex = RankExecutor(job, lower(job, 0))
    return job, ex, ex.init_state(build_model(cfg))


def test_growth_counter_seed_and_rng_round_trip(tmp_path):
    """A checkpoint holds the fp16 growth counter, the random ops' seed and
    the rank's torch RNG state; the same Job gets all back, another Job
    (another layout) the counter and the seed (the random ops' numbers do
    not depend on the layout), its torch generator left as it is."""
    import torch

    from meshplan.runtime import checkpoint

    job, ex, state = _one_rank()
    torch.manual_seed(7)
    ex.ctx.random.seed = 1234
    checkpoint.save(str(tmp_path), checkpoint.stage(state, ex.ctx, 3, good_steps=17),
                    checkpoint.SavedJob(job), 3)
    after_save = torch.rand(5)
    torch.manual_seed(99)
    ex.ctx.random.seed = 0
    got = checkpoint.load(str(tmp_path), state, ex.ctx)
    assert got == checkpoint.Resumed(next_step=3, good_steps=17, rng=True)
    assert torch.rand(5).equal(after_save) and ex.ctx.random.seed == 1234
    other, ex2, state2 = _one_rank(micro_batch_size=4)
    assert other.digest() != job.digest()
    torch.manual_seed(99)
    untouched = torch.rand(5)
    torch.manual_seed(99)
    assert checkpoint.load(str(tmp_path), state2, ex2.ctx) == \
        checkpoint.Resumed(next_step=3, good_steps=17, rng=False)
    assert torch.rand(5).equal(untouched) and ex2.ctx.random.seed == 1234


def test_async_save_writes_the_staged_copy_then_marks_it(tmp_path, monkeypatch):
    """The shard is written while training goes on: what it holds is the
    state when the save started (host copies), not what the next step wrote
    over it in place, and `COMPLETE` appears only once the shard is
    written. The writer is held back until the state has changed."""
    import threading

    import torch
    import torch.distributed.checkpoint as dcp

    from meshplan.runtime import checkpoint
    from meshplan.runtime.async_save import AsyncSaver

    job, ex, state = _one_rank()
    before = checkpoint.state_slices(state, ex.ctx)
    before = {k: t.clone() for k, t in before.items()}
    go = threading.Event()

    class Held(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            assert go.wait(60)
            return super().write_data(plan, planner)

    monkeypatch.setattr(checkpoint, "shard_writer", lambda path, step: Held(path))
    saver = AsyncSaver()
    saver.start(str(tmp_path), checkpoint.stage(state, ex.ctx, 1, copy=True),
                checkpoint.SavedJob(job), 1)
    for t in state.values():  # the next step's in-place update
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.add_(1.0)
    saver.poll()
    assert not (tmp_path / checkpoint.COMPLETE).exists()
    go.set()
    saver.wait()
    assert (tmp_path / checkpoint.COMPLETE).is_file()
    saved = checkpoint.read_slices(str(tmp_path))
    assert saved.keys() == before.keys()
    assert all(saved[k].equal(before[k]) for k in before)
