"""`--kernels inductor` (`runtime/fused.py`): each run of a segment's compute
ops becomes one FX graph. With the compile step left out (the graph run as
it is: the same kernels in the same order) every layout trains bitwise equal
to eager kernels, so the runs, their inputs and their outputs are right; with
Inductor itself, the zoo trains equal to eager PyTorch within fp32 bounds."""

from __future__ import annotations

import dataclasses
import gc
import glob
import os
import tempfile

import pytest
import torch

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import verify
from meshplan.errors import ConfigError
from meshplan.ir import Op, Ref, Role
from meshplan.ir.mesh import Mesh
from meshplan.ir.optimizer_config import OptimizerConfig
from meshplan.models import build_model, example_batch, model_config
from meshplan.ops import kernels
from meshplan.ops.table import rule_for
from meshplan.runtime import builds, codegen, fused, kernel_cache
from meshplan.runtime.data import split_microbatches
from meshplan.runtime.local import local_ranks, train_local
from tests.runtime._util import GPT_1_RANK, GPT_4D

LAYOUTS = {  # name: (model, strategy fields)
    "gpt 1 rank": ("gpt", GPT_1_RANK),
    "gpt dp2·tp2·pp2·vpp2": ("gpt", GPT_4D),
    "gpt zbv zero3": ("gpt", dict(dp=2, pp=2, vpp=2, schedule="zbv", zero=3,
                                  global_batch_size=8, micro_batch_size=2)),
    "gpt recompute full": ("gpt", dict(pp=2, recompute="full", global_batch_size=8,
                                       micro_batch_size=2)),
    "bert dp2·tp2": ("bert", dict(dp=2, tp=2, global_batch_size=8, micro_batch_size=2)),
    "resnet dp2·pp2": ("resnet", dict(dp=2, pp=2, global_batch_size=8, micro_batch_size=2)),
}


def _train(name: str, kernels: str, steps: int = 2, optimizer="adamw"):
    model, fields = LAYOUTS[name]
    cfg = model_config(model, "tiny")
    s = zoo_strategy(model, cfg, **fields)
    job = plan_model(model, "tiny", Mesh(1, s.dp * s.tp * s.pp), s, optimizer).job
    torch.manual_seed(0)
    hub, ranks = local_ranks(job, build_model(cfg), kernels=kernels, timeout_s=600)
    run = train_local(job, hub, ranks, [example_batch(cfg, 8, seed=k) for k in range(steps)],
                      timeout_s=600)
    return run, ranks


def _optimizer_loop(monkeypatch):
    """The optimizer's per-tensor loop with `--kernels inductor` too, not
    torch's fused kernel (equal within rounding: `test_the_fused_optimizer_...`)."""
    loop = kernels.by_kernel
    monkeypatch.setattr(kernels, "by_kernel", lambda step, lists, fused: loop(step, lists, False))


def _graphs_as_they_are(monkeypatch) -> dict[str, list[str]]:
    """Each run's graph run as it is (its aten kernels, in order): nothing
    built, nothing loaded. Returns the artifact keys asked to be built
    ("noted", after the first step) and loaded ("called"), as they come."""
    keys: dict[str, list[str]] = {"noted": [], "called": []}

    def key(gm, args, device) -> str:
        return kernel_cache._artifact(gm, args, device)[3]

    def load(gm, args, device):
        keys["called"].append(key(gm, args, device))
        return gm

    def build(gm, args, device, wait):
        keys["noted"].append(key(gm, args, device))
        return True

    monkeypatch.setattr(fused, "ahead_of_time", load)
    monkeypatch.setattr(builds, "build_ahead", build)
    monkeypatch.setattr(builds, "is_built", lambda *_: False)
    monkeypatch.setattr(builds, "helper_count", lambda *_: 0)  # they would build for real
    return keys


@pytest.mark.parametrize("name", LAYOUTS)
def test_runs_as_graphs_equal_eager_kernels_bitwise(name, monkeypatch):
    """And the second step calls exactly the variants the first noted."""
    keys = _graphs_as_they_are(monkeypatch)
    _optimizer_loop(monkeypatch)
    eager, _ = _train(name, "eager")
    graphs, ranks = _train(name, "inductor")
    assert graphs.losses == eager.losses
    for r, mine in graphs.slices.items():
        for key, t in mine.items():
            assert torch.equal(t, eager.slices[r][key]), (r, key)
    runs = [run for ex, _ in ranks for seg in ex.segments.values() for run in seg[0].runs]
    assert runs and all(len(r.ops) > 1 for r in runs)
    assert keys["noted"] and sorted(keys["called"]) == sorted(keys["noted"])


def test_a_run_is_built_only_with_two_ops_to_fuse():
    """Views and library kernels (matmuls: the ops priced by their flops) are
    the same compiled or not: a run with one op besides them runs eagerly,
    unbuilt; with two, they make one run."""
    ops = [Op(0, "aten.reshape.default", (Ref(1), (8, 4)), (2,)),
           Op(1, "aten.t.default", (Ref(2),), (3,)),
           Op(2, "aten.mm.default", (Ref(3), Ref(2)), (4,)),
           Op(3, "aten.gelu.default", (Ref(4),), (5,))]
    assert [rule_for(op.kind).fuses for op in ops] == [False, False, False, True]
    groups, runs = codegen._runs(ops, {}, {}, {5})
    assert not runs and [len(g) for g in groups] == [1, 1, 1, 1]
    add = Op(4, "aten.add.Tensor", (Ref(5), Ref(4)), (6,))
    groups, runs = codegen._runs([*ops, add], {}, {}, {6})
    assert [len(g) for g in groups] == [5] and runs == {0: ([1], [6])}


def test_an_update_is_in_no_run_even_among_ops_that_fuse():
    """An optimizer update between ops that fuse ends the run before it and
    starts none: torch's fused kernel runs it (`OpRule.fused_batched`)."""
    hp = (("lr", 1e-3), ("beta1", 0.9), ("beta2", 0.999), ("eps", 1e-8),
          ("weight_decay", 0.0))
    ops = [Op(0, "aten.mul.Tensor", (Ref(1), Ref(1)), (2,)),
           Op(1, "aten.add.Tensor", (Ref(2), Ref(1)), (3,)),
           Op(2, "meshplan.adamw", (Ref(4), Ref(3), Ref(5), Ref(6), Ref(7)), (8, 9, 10, 11),
              hp),
           Op(3, "aten.mul.Tensor", (Ref(8), Ref(8)), (12,)),
           Op(4, "aten.add.Tensor", (Ref(12), Ref(8)), (13,))]
    groups, runs = codegen._runs(ops, {}, {}, {9, 10, 11, 13})
    assert [[op.id for op in g] for g in groups] == [[0, 1], [2], [3, 4]]
    assert sorted(runs) == [0, 2]


def test_each_run_built_or_loaded_is_the_ranks_progress(monkeypatch):
    """The first step runs every run with eager kernels (its actions alone
    stamp); the second starts by building what it noted, minutes with a cold
    cache, then loads each variant at its first call: the stall watchdog
    (`runtime/launch.py`) sees each build and each load as the rank's
    progress, as it sees an action's start. Later steps' actions alone stamp."""
    _graphs_as_they_are(monkeypatch)
    model, fields = LAYOUTS["gpt 1 rank"]
    cfg = model_config(model, "tiny")
    job = plan_model(model, "tiny", Mesh(1, 1), zoo_strategy(model, cfg, **fields)).job
    torch.manual_seed(0)
    _, [(ex, state)] = local_ranks(job, build_model(cfg), kernels="inductor")
    batches = [split_microbatches(example_batch(cfg, 8, seed=i), job.strategy.num_microbatches)
               for i in range(3)]
    stamps: list[list[int]] = []
    for batch in batches:
        stamps.append([])
        ex.on_action = stamps[-1].append
        ex.step(state, batch)
    actions = list(range(len(ex.plan.actions)))
    runs = [run for seg in ex.segments.values() for run in seg[0].runs]
    variants = sum(len(run.built) for run in runs)
    assert variants > len(runs) > 0  # the backward's second micro-batch: a variant of its own
    assert stamps[0] == actions
    assert len(stamps[1]) == len(actions) + 2 * variants and sorted(set(stamps[1])) == actions
    assert stamps[2] == actions


def test_a_run_inductor_refuses_runs_eagerly_with_a_note(monkeypatch):
    def refuse(gm, args, device):
        raise kernel_cache.Refused("planted: no lowering for this op")

    monkeypatch.setattr(fused, "ahead_of_time", refuse)
    monkeypatch.setattr(builds, "build_ahead", lambda gm, args, device, wait: True)
    monkeypatch.setattr(builds, "helper_count", lambda *_: 0)  # they would build for real
    _optimizer_loop(monkeypatch)
    with pytest.warns(UserWarning, match="Inductor refused a run of .* planted: no lowering"):
        refused, ranks = _train("gpt 1 rank", "inductor")
    eager, _ = _train("gpt 1 rank", "eager")
    assert refused.losses == eager.losses
    for key, t in refused.slices[0].items():
        assert torch.equal(t, eager.slices[0][key]), key


def test_the_optimizer_runs_torchs_fused_kernel_in_no_run(monkeypatch):
    """With Inductor the updates are in no run: one call of torch's fused
    kernel per group (`OpRule.fused_batched`); eager kernels keep torch's
    per-tensor loop, as `torch.optim` runs it on a CPU. With clipping, whose
    norm's ops fuse and come right before the updates. (The runs' graphs
    run as they are: which ops a run holds does not depend on its build.)"""
    _graphs_as_they_are(monkeypatch)
    clipping = dataclasses.replace(OptimizerConfig.default("adamw"), max_grad_norm=1.0)
    for mode in ("inductor", "eager"):
        _, ranks = _train("gpt 1 rank", mode, steps=1, optimizer=clipping)
        (ex, _), = ranks
        segments = [seg[0] for seg in ex.segments.values()]
        runs = [op for seg in segments for run in seg.runs for op in run.ops]
        assert not any(rule_for(op.kind).fused_batched for op in runs)
        updates = 0
        for seg in segments:
            lines = seg.source.splitlines()
            for at, ids in seg.line_ops.items():
                if rule_for(ex.view.op_of[ids[0]].kind).fused_batched:
                    updates += len(ids)
                    assert ("fused=True" in lines[at - 1]) == (mode == "inductor"), lines[at - 1]
        assert updates == len(ex.view.inputs_by_role(Role.PARAM))


def test_no_compiler_is_one_line(monkeypatch):
    monkeypatch.setattr(fused.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs a C.. compiler .* use --kernels eager"):
        fused.check_kernels("inductor", "cpu")
    fused.check_kernels("eager", "cpu")
    with pytest.raises(ConfigError, match="kernels"):
        fused.check_kernels("fast", "cpu")


@pytest.mark.skipif(not fused.can_compile(), reason="no C++ compiler for Inductor on cpu")
def test_inductor_trains_gpt_equal_to_eager_pytorch():
    r = verify("gpt", "tiny", steps=3, optimizer="adamw",
               strategy=zoo_strategy("gpt", model_config("gpt", "tiny"), **GPT_1_RANK),
               run_options={"kernels": "inductor"})
    assert r.ok, r.problems
    assert r["max_abs_diff"] <= 1e-5, (r.losses, r.ref_losses)


# With Inductor itself, on processes (`verify`): the layouts of the issue.
# ResNet with SGD: with AdamW its step-1 update of a few conv weights whose
# gradient is near Adam's eps (8e-8, reordered by Inductor's reductions to
# 8.3e-8) moves 1e-5 another way, which BatchNorm carries into a 2% other
# update of `blocks.0.bn1.bias` by step 3 (docs/concepts/kernels.md).
SGD = {"resnet"}
VERIFIED = {  # name: (model, ranks, strategy fields)
    "bert 1 rank": ("bert", 1, dict(global_batch_size=8, micro_batch_size=4)),
    "resnet 1 rank": ("resnet", 1, dict(global_batch_size=8, micro_batch_size=4)),
    "gpt dp2·tp2·pp2·vpp2": ("gpt", 8, LAYOUTS["gpt dp2·tp2·pp2·vpp2"][1]),
    "bert dp2·tp2·pp2": ("bert", 8, dict(dp=2, tp=2, pp=2, global_batch_size=8,
                                          micro_batch_size=2)),
    "resnet dp2·pp2": ("resnet", 4, LAYOUTS["resnet dp2·pp2"][1]),
    "hf llama tp2·pp2": ("hf:llama", 4, dict(tp=2, pp=2, global_batch_size=8,
                                              micro_batch_size=2)),
    "gpt zbv zero3": ("gpt", 4, LAYOUTS["gpt zbv zero3"][1]),
    "gpt recompute full": ("gpt", 2, LAYOUTS["gpt recompute full"][1]),
}


# ResNet tiny at dp2·pp2 builds 79 runs on a cold cache, 8 s or more each (each
# BatchNorm's statistics, all-reduced over dp, end a run): 707 s, and once past
# pytest's 900 s, on a 2-core machine
COLD_BUILD_S = {"resnet dp2·pp2": 1800}


@pytest.mark.slow
@pytest.mark.skipif(not fused.can_compile(), reason="no C++ compiler for Inductor on cpu")
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.timeout(COLD_BUILD_S[n])] if n in COLD_BUILD_S else [])
    for n in VERIFIED])
def test_inductor_verifies_at_every_layout(name):
    model, ranks, fields = VERIFIED[name]
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    cfg = model_config(model, "tiny")
    before = _unpacked()
    r = verify(model, "tiny", steps=3, optimizer="sgd" if model in SGD else "adamw",
               mesh=Mesh(1, ranks),
               strategy=zoo_strategy(model, cfg, **fields),
               run_options={"kernels": "inductor"})  # the kernels' wait (900 s)
    assert r.ok, r.problems
    assert r["max_abs_diff"] <= 1e-5, (r.losses, r.ref_losses)
    notes = [n for v in r.details.get("ranks", {}).values() for n in v.get("kernel_notes", [])]
    assert not notes, notes  # Inductor compiled every run
    # each rank's loaders deleted the folders they unpacked their packages into
    # (a 1-rank run's are this process's: freed with the cycles holding them)
    gc.collect()
    assert not _unpacked() - before, sorted(_unpacked() - before)[:3]


def _unpacked() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "aotinductor_*")))


def test_the_command_without_a_compiler_is_one_line():
    """`--kernels inductor` where $CXX names no compiler: exit 2, one line,
    before any rank starts."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "meshplan", "run", "--model", "gpt", "--size",
                        "tiny", "--steps", "1", "--kernels", "inductor"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CXX": "/nonexistent/c++"})
    assert p.returncode == 2, p
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "needs a C++ compiler" in p.stderr and "--kernels eager" in p.stderr
