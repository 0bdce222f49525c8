"""A model's own casts under bf16 (`capture/model_casts.py`): captured as
eager autocast resolves them, a router with autocast off left in fp32, and
a graph captured for another precision refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshplan.api as mp
from meshplan.autodiff import OptimizerConfig, build_train_step
from meshplan.capture import capture
from meshplan.driver.executor import Executor
from meshplan.errors import ConfigError
from meshplan.ir import Role
from meshplan.passes.precision import CAST, apply_precision
from tests.capture.functions_toy import Mixed


class Norm(nn.Module):
    """transformers' RMSNorm: fp32 inside, back to the input's dtype."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


class QNorm(nn.Module):
    """A norm on a projection's output (OLMo 2's q/k norms): under autocast
    its input is bf16, so it rounds its result back to bf16."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.norm = Norm(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        return self.out(self.norm(self.q(x))).float().pow(2).mean()  # fp32 on any list


class Gated(nn.Module):
    """`x` read by two linears (autocast casts it for each), and a softmax
    bf16 under CPU autocast but fp32 under meshplan's lists (CUDA's), so
    the model's `.float()` after it changes nothing there."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.up = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)

    def forward(self, x):
        return (self.up(x).float() * self.gate(x).softmax(-1).float()).pow(2).mean()


class Routed(nn.Module):
    """A router computed with autocast off (transformers' MoE gates)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.router = nn.Linear(d, d)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            logits = self.router(x.float())
        return (self.proj(x).float() * logits.softmax(-1)).sum()


class Mixes(nn.Module):
    """An einsum of a linear's bf16 output and an fp32 weight (PEGASUS-X):
    eager autocast computes it as its bmm, in bf16."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.w = nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x):
        return torch.einsum("bi,ij->bj", self.proj(x), self.w).float().pow(2).mean()


def _grads(step_graph, module, x) -> tuple[float, dict]:
    """meshplan's loss and each parameter's gradient (SGD at rate 1)."""
    ex = Executor(step_graph)
    state = ex.init_state(module)
    start = {k: v.clone() for k, v in state.items() if v is not None}
    loss = ex.step(state, [(x,)])
    return loss, {k: start[k] - state[k] for k, _ in module.named_parameters()}


def _eager(module, x) -> tuple[float, dict]:
    module.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module(x)
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in module.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_a_norms_round_trip_to_its_inputs_dtype_is_computed_as_eager_autocast():
    torch.manual_seed(0)
    module, x = QNorm(), torch.randn(8, 16)
    loss, grads = _eager(module, x)
    opt = OptimizerConfig("sgd", lr=1.0)
    graph = capture(module, (x,), precision="bf16")
    assert graph.facts.captured_for == "bf16"
    to_low = [op for op in graph.ops if op.kind == CAST and op.module_path == "norm"
              and dict(op.kwargs)["dtype"].name == "bfloat16"]
    assert len(to_low) == 1  # `x.to(dtype)`, an identity in the fp32 capture
    mine, mine_grads = _grads(build_train_step(apply_precision(graph, "bf16"), opt), module, x)
    assert mine == loss
    assert all(_rel(mine_grads[k], grads[k]) < 2e-3 for k in grads), \
        {k: _rel(mine_grads[k], grads[k]) for k in grads}
    # the fp32 capture loses the cast: the step is another one (what meshplan ran before)
    lost = build_train_step(apply_precision(capture(module, (x,)), "bf16"), opt)
    lost_loss, lost_grads = _grads(lost, module, x)
    assert lost_loss != loss and max(_rel(lost_grads[k], grads[k]) for k in grads) > 3e-3


def test_casts_are_shared_and_none_changes_nothing():
    x = torch.randn(8, 16)
    graph = capture(Gated(), (x,), precision="bf16")
    changes_nothing = [op for op in graph.ops if op.kind == CAST and op.module_path == ""
                       and dict(op.kwargs)["dtype"].name == "float32"]
    assert len(changes_nothing) == 2  # the model's two .float(), as CPU autocast runs them
    planned = apply_precision(graph, "bf16")
    casts = [(op.args[0].id, dict(op.kwargs)["dtype"]) for op in planned.ops if op.kind == CAST]
    assert len(casts) == len(set(casts))  # one cast per (value, dtype), autocast's or not
    assert all(planned.values[v].meta.dtype != d for v, d in casts)  # none an identity
    (x_in,) = planned.inputs_by_role(Role.DATA)
    assert len([op for op in planned.ops if op.kind == CAST and op.args[0].id == x_in.id]) == 1


def test_a_linear_run_with_autocast_off_stays_fp32():
    torch.manual_seed(0)
    module, x = Routed(), torch.randn(8, 16)
    g = apply_precision(capture(module, (x,), precision="bf16"), "bf16")
    name = {v.id: v.name for v in g.values}  # the weights' casts keep their names' order
    dtypes = {name[op.args[1].id]: [g.values[r].meta.dtype.name for r in op.refs()]
              for op in g.ops if op.kind == "aten.linear.default"}
    assert dtypes == {"router.weight": ["float32"] * 3,
                      next(k for k in dtypes if k != "router.weight"): ["bfloat16"] * 3}
    loss, grads = _eager(module, x)
    mine, mine_grads = _grads(build_train_step(g, OptimizerConfig("sgd", lr=1.0)), module, x)
    assert mine == pytest.approx(loss, rel=1e-6)
    assert _rel(mine_grads["router.weight"], grads["router.weight"]) < 2e-3


def test_an_einsum_of_bf16_and_fp32_computes_in_bf16_as_eager():
    torch.manual_seed(0)
    module, x = Mixes(), torch.randn(8, 16)
    loss, grads = _eager(module, x)
    g = apply_precision(capture(module, (x,), precision="bf16"), "bf16")
    (op,) = [op for op in g.ops if op.kind == "aten.einsum.default"]
    assert {g.values[r].meta.dtype.name for r in op.refs()} == {"bfloat16"}
    mine, mine_grads = _grads(build_train_step(g, OptimizerConfig("sgd", lr=1.0)), module, x)
    assert mine == pytest.approx(loss, rel=1e-6)
    # each gradient within bf16's rounding (2^-8) of eager's, which takes the bmm's backward
    assert all(_rel(mine_grads[k], grads[k]) < 4e-3 for k in grads)


def test_a_kept_whole_function_runs_under_the_autocast_it_was_captured_in():
    """A `torch.autograd.Function` (`ops/function_op.py`) whose matmuls mix
    bf16 and fp32, as YOSO's: planned (its shapes on fake CPU tensors),
    trained, and equal to eager autocast's step."""
    torch.manual_seed(0)
    module, x = Mixed(), torch.randn(4, 8)
    loss, grads = _eager(module, x)
    g = apply_precision(capture(module, (x,), precision="bf16"), "bf16")
    mine, mine_grads = _grads(build_train_step(g, OptimizerConfig("sgd", lr=1.0)), module, x)
    assert mine == loss
    assert all(_rel(mine_grads[k], grads[k]) < 2e-3 for k in grads)  # bf16's reordering


def test_a_meta_module_is_captured_as_one_with_weights():
    torch.manual_seed(0)
    real = capture(QNorm(), (torch.randn(8, 16),), precision="bf16")
    with torch.device("meta"):
        meta = capture(QNorm(), (torch.randn(8, 16),), precision="bf16")
    assert [(op.kind, [meta.values[o].meta for o in op.outputs]) for op in meta.ops] == \
        [(op.kind, [real.values[o].meta for o in op.outputs]) for op in real.ops]


def test_a_graph_captured_for_another_precision_is_refused():
    x = torch.randn(8, 16)
    s = mp.Strategy(global_batch_size=8, micro_batch_size=8, precision="bf16")
    with pytest.raises(ConfigError, match='captured for fp32 but the strategy trains in bf16.*'
                                          'capture with precision="bf16"'):
        mp.plan(mp.capture(QNorm(), (x,)), mp.Mesh(1, 1), s)
    with pytest.raises(ConfigError, match='captured for bf16 but the strategy trains in fp32'):
        mp.plan(mp.capture(QNorm(), (x,), precision="bf16"), mp.Mesh(1, 1),
                mp.Strategy(global_batch_size=8, micro_batch_size=8))
