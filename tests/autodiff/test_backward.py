"""Structure and numerics of `build_train_step` on the tiny GPT.

Structure: phases, `grad_of` provenance, one `grad_sum` per value with
several gradient contributions, one accumulator and one optimizer op per
parameter. Numerics: a step over several micro-batches equals eager
accumulation of loss / num_microbatches.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch import nn

from meshplan.autodiff.backward import build_train_step
from meshplan.autodiff.optimizer import OptimizerConfig, torch_optimizer
from meshplan.capture import capture
from meshplan.driver.executor import Executor
from meshplan.ir import ABSENT, Phase, Ref, Role, check_well_formed
from meshplan.models import build_model, example_batch, model_config
from meshplan.ops.table import rule_for


@pytest.fixture(scope="module")
def gpt_step():
    torch.manual_seed(0)
    cfg = model_config("gpt", "tiny")
    model = build_model(cfg)
    graph = capture(model, example_batch(cfg, 2))
    return graph, build_train_step(graph, OptimizerConfig("sgd"))


def _defining_op(step):
    return {o: op for op in step.ops for o in op.outputs if o != ABSENT}


def test_phases_are_forward_then_backward_then_optimizer(gpt_step):
    graph, step = gpt_step
    phases = [op.phase for op in step.ops]
    n_fwd = len(graph.ops)
    assert step.ops[:n_fwd] == graph.ops
    assert set(phases[:n_fwd]) == {Phase.FORWARD}
    n_opt = phases.count(Phase.OPTIMIZER)
    assert set(phases[n_fwd:len(phases) - n_opt]) == {Phase.BACKWARD}
    assert set(phases[len(phases) - n_opt:]) == {Phase.OPTIMIZER}


def test_backward_ops_point_to_their_forward_op(gpt_step):
    _graph, step = gpt_step
    consumers = step.consumers()
    seeds = 0
    for op in step.ops_in(Phase.BACKWARD):
        if op.kind == "meshplan.accumulate_grad":
            assert op.grad_of == -1  # per parameter, not per forward op
            continue
        if op.grad_of == -1:  # only the loss seed has no forward op
            assert op.kind == "aten.full.default"  # made, not read off the loss
            assert op.args[0] == step.values[step.loss].meta.shape
            seeds += 1
            continue
        fwd = step.ops[op.grad_of]
        assert fwd.phase is Phase.FORWARD, (op.kind, fwd.kind)
        if op.kind != "meshplan.grad_sum":
            assert op.module_path == fwd.module_path, (op.kind, op.module_path, fwd.module_path)
            continue
        # A grad_sum belongs to the op that made the summed value (grad_of),
        # but sits in the module of that value's first forward consumer (the
        # last contribution, since backward walks the ops in reverse).
        (summed,) = [o for o in fwd.outputs if o in consumers]
        assert op.module_path == consumers[summed][0].module_path
    assert seeds == 1


def test_no_op_reads_the_loss_and_a_count_gets_no_gradient(gpt_step):
    """The step never waits for the loss's value (its reduction over dp runs
    in the background), and cross-entropy's total weight (a count of
    targets) carries no gradient: no dead ops for it."""
    _graph, step = gpt_step
    assert not [op for op in step.ops if step.loss in op.refs()]
    read = {r for op in step.ops for r in op.refs()} | {u.value for u in step.updates}
    dead = [op.kind for op in step.ops_in(Phase.BACKWARD)
            if not any(o in read for o in op.outputs if o != ABSENT)]
    assert not dead, dead


def _contributions(graph) -> Counter:
    """Per forward value: how many gradient contributions backward must sum.

    A consumer contributes once per argument slot holding the value, if the
    consumer is differentiable and on a path to the loss, and the value
    depends on a float parameter."""
    wants = {v.id for v in graph.inputs_by_role(Role.PARAM) if v.meta.is_float}
    for op in graph.ops:
        if rule_for(op.kind).differentiable and wants.intersection(op.refs()):
            wants.update(o for o in op.outputs if graph.values[o].meta.is_float)
    to_loss = {graph.loss}
    counts: Counter = Counter()
    for op in reversed(graph.ops):
        if not to_loss.intersection(op.outputs):
            continue
        to_loss.update(op.refs())
        if rule_for(op.kind).differentiable:
            counts.update(r for r in op.refs() if r in wants)
    return counts


def test_one_grad_sum_per_value_with_several_contributions(gpt_step):
    graph, step = gpt_step
    defining = _defining_op(step)
    params = {v.id for v in graph.inputs_by_role(Role.PARAM)}
    many = {v: n for v, n in _contributions(graph).items() if n > 1}
    # The residual stream (the embeddings' sum, then each block's middle and
    # output) feeds a layer norm and a residual add; the last block's output
    # feeds ln_f only: 1 + 2 * layers - 1 values.
    assert len(many) == 2 * model_config("gpt", "tiny").layers
    sums = [op for op in step.ops if op.kind == "meshplan.grad_sum"]
    expected = Counter(-1 if v in params else defining[v].id for v in many)
    assert Counter(op.grad_of for op in sums) == expected
    assert sorted(len(op.args) for op in sums) == sorted(many.values())


def test_one_accumulator_and_one_optimizer_op_per_parameter(gpt_step):
    graph, step = gpt_step
    params = {v.id: v.name for v in graph.inputs_by_role(Role.PARAM)}
    accs = [op for op in step.ops if op.kind == "meshplan.accumulate_grad"]
    opts = [op for op in step.ops if op.kind == "meshplan.sgd"]
    assert len(accs) == len(opts) == len(params)
    acc_of = {}
    for op in accs:
        grad_in = step.values[op.args[0].id]
        assert grad_in.role is Role.GRAD
        fqn = grad_in.name.removesuffix("@grad")
        assert fqn in params.values()
        assert op.module_path == fqn.rpartition(".")[0]
        acc_of[fqn] = op.outputs[0]
    assert len(acc_of) == len(params)
    optimized = Counter(params[op.args[0].id] for op in opts)
    assert set(optimized) == set(params.values()) and set(optimized.values()) == {1}
    for op in opts:
        assert op.phase is Phase.OPTIMIZER
        assert op.args[1] == Ref(acc_of[params[op.args[0].id]])
    updates = Counter(u.name for u in step.updates)
    assert all(updates[f"{n}@grad"] == 1 and updates[n] == 1 for n in params.values())


def test_microbatch_accumulation_matches_eager():
    torch.manual_seed(0)
    cfg = model_config("gpt", "tiny")
    model = build_model(cfg)
    opt_cfg = OptimizerConfig("sgd", lr=0.1, momentum=0.9, weight_decay=1e-4)
    m = 4
    step = build_train_step(capture(model, example_batch(cfg, 2)), opt_cfg, num_microbatches=m)
    assert step.ops[-1].phase is Phase.OPTIMIZER
    ex = Executor(step)
    state = ex.init_state(model)
    opt = torch_optimizer(opt_cfg, model)
    for seed in (1, 2):  # two steps: the accumulators restart, momentum carries
        tokens, targets = example_batch(cfg, 2 * m, seed=seed)
        mbs = [(tokens[i:i + 2], targets[i:i + 2]) for i in range(0, 2 * m, 2)]
        ours = ex.step(state, mbs)
        opt.zero_grad()
        losses = []
        for mb in mbs:
            loss = model(*mb)
            (loss / m).backward()
            losses.append(loss.item())
        opt.step()
        assert abs(ours - sum(losses) / m) <= 1e-5
        for name, p in model.named_parameters():
            torch.testing.assert_close(state[f"{name}@grad"], p.grad, rtol=0, atol=1e-5,
                                       msg=name)
            torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=1e-5, msg=name)


class _SharedGrad(nn.Module):
    """`a + b` hands both params one gradient tensor; `b.sum()` an expanded one."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.a = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(3, dtype=torch.float64))

    def forward(self, x):
        if self.mode == "shared":
            return ((self.a + self.b) * x).sum()
        return (self.a * x).sum() + self.b.sum()


@pytest.mark.parametrize("mode", ["shared", "expanded"])
def test_accumulation_when_gradients_alias(mode):
    torch.manual_seed(0)
    model = _SharedGrad(mode)
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(2)]
    opt = OptimizerConfig("sgd", lr=1.0, momentum=0.0, weight_decay=0.0)
    ex = Executor(build_train_step(capture(model, (xs[0],)), opt, num_microbatches=2))
    state = ex.init_state(model)
    ex.step(state, [(x,) for x in xs])
    for x in xs:
        (model(x) / 2).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(state[f"{name}@grad"], p.grad, rtol=0, atol=1e-12)


def test_the_step_reads_only_state_and_its_own_values(gpt_step):
    """The step runs once, after the micro-batches' values are gone: its ops
    read the state (the accumulators' sums among it), never a forward or
    backward value. Planted: an optimizer op reads a forward activation."""
    _, step = gpt_step
    check_well_formed(step)
    i = next(k for k, op in enumerate(step.ops) if op.phase is Phase.OPTIMIZER)
    activation = step.ops[0].outputs[0]
    op = step.ops[i]
    planted = replace(step, ops=step.ops[:i] + (
        replace(op, args=(Ref(activation),) + op.args[1:]),) + step.ops[i + 1:])
    with pytest.raises(AssertionError, match="made per micro-batch"):
        check_well_formed(planted)
