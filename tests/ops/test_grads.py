"""Exact gradient rules (`ops/table.py` `_GRADS`) against eager autograd.

Each case captures a tiny module that applies one op to parameters (and
sometimes data), weights the op's outputs with a fixed random cotangent,
trains one plain-SGD step (lr=1) and compares the gradient accumulator
`<fqn>@grad` and the updated parameter with `loss.backward()`. It also asserts
which rule ran: exact cases emit no `meshplan.vjp` op, generic cases do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshplan.autodiff.backward import build_train_step
from meshplan.autodiff.optimizer import OptimizerConfig
from meshplan.capture import capture
from meshplan.driver.executor import Executor
from meshplan.driver.same_masks import SameMasks
from meshplan.ir import Phase
from meshplan.ir.kinds import DROPOUT
from meshplan.ops import counter_rng
from meshplan.ops.table import exact_kinds

F64, F32 = torch.float64, torch.float32
SGD = OptimizerConfig("sgd", lr=1.0, momentum=0.0, weight_decay=0.0)


@dataclass(frozen=True)
class Case:
    """One op under test: `fn(*params, *inputs)` gives a tensor or a tuple."""

    fn: Callable
    shapes: tuple
    kind: str                       # the aten kind the case must capture
    inputs: Callable = lambda: ()   # data inputs, made after seeding
    generic: bool = False           # expect the generic (vjp) rule
    positive: bool = False          # params in [0.5, 1.5) (log, sqrt, ...)
    dtype: torch.dtype = F64
    tol: float = 1e-10
    extra: dict = field(default_factory=dict)


class OpModule(nn.Module):
    """Params `p0, p1, ...`; loss = sum_i (out_i * cot_i).sum()."""

    def __init__(self, case: Case):
        super().__init__()
        self.fn = case.fn
        for i, shape in enumerate(case.shapes):
            t = torch.rand(shape, dtype=case.dtype) + 0.5 if case.positive \
                else torch.randn(shape, dtype=case.dtype)
            self.register_parameter(f"p{i}", nn.Parameter(t))
        self.n = len(case.shapes)

    def add_cotangents(self, *inputs) -> None:
        with torch.no_grad():
            outs = self._outs(*inputs)
        for i, o in enumerate(outs):
            self.register_buffer(f"cot{i}", torch.randn(o.shape, dtype=o.dtype))

    def _outs(self, *inputs):
        out = self.fn(*(getattr(self, f"p{i}") for i in range(self.n)), *inputs)
        return out if isinstance(out, (tuple, list)) else (out,)

    def forward(self, *inputs):
        outs = self._outs(*inputs)
        loss = (outs[0] * self.cot0).sum()
        for i, o in enumerate(outs[1:], 1):
            loss = loss + (o * getattr(self, f"cot{i}")).sum()
        return loss


def train_one_step(module: nn.Module, inputs: tuple, seed: int | None = None):
    """Capture, build the SGD train step, run one step; (step graph, state, loss)."""
    step = build_train_step(capture(module, inputs), SGD)
    ex = Executor(step)
    state = ex.init_state(module)
    if seed is not None:
        torch.manual_seed(seed)
    loss = ex.step(state, [inputs])
    return step, state, loss


def eager_one_step(module: nn.Module, inputs: tuple, seed: int | None = None) -> float:
    """`loss.backward()` on `module`; leaves `.grad` on its parameters."""
    if seed is not None:
        torch.manual_seed(seed)
    loss = module(*inputs)
    loss.backward()
    return loss.item()


def assert_rule_used(step, kind: str, generic: bool) -> None:
    fwd = {op.kind for op in step.ops_in(Phase.FORWARD)}
    assert kind in fwd, f"case did not capture {kind}: {sorted(fwd)}"
    vjps = [op.args[0] for op in step.ops if op.kind == "meshplan.vjp"]
    if generic:
        assert kind in vjps, f"{kind} should use the generic rule; vjp ops: {vjps}"
    else:
        assert kind in exact_kinds()
        assert not vjps, f"exact case emitted meshplan.vjp for {vjps}"


def assert_grads_match(module: nn.Module, state: dict, tol: float) -> None:
    for name, p in module.named_parameters():
        got, want = state[f"{name}@grad"], p.grad
        assert got.shape == want.shape and got.dtype == want.dtype, name
        scale = max(1.0, want.abs().max().item())
        err = (got - want).abs().max().item()
        assert err <= tol * scale, f"{name}: max |grad diff| {err:.3g}"
        err = (state[name] - (p.detach() - p.grad)).abs().max().item()
        assert err <= tol * scale, f"{name}: max |param diff| {err:.3g}"


def _ints(*shape, high=5, low=0):
    return lambda: (torch.randint(low, high, shape),)


def _data(*shape, dtype=F64):
    return lambda: (torch.randn(shape, dtype=dtype),)


def _ce_targets():
    t = torch.randint(0, 5, (6,))
    t[1] = t[4] = -100
    return (t,)


C = Case
CASES = {
    # pointwise, with broadcasting both ways, scalar operands and alpha
    "add": C(lambda a, b: a + b, ((3, 4), (3, 4)), "aten.add.Tensor"),
    "add_bcast_b": C(lambda a, b: a + b, ((3, 4), (4,)), "aten.add.Tensor"),
    "add_bcast_both": C(lambda a, b: a + b, ((3, 1), (1, 4)), "aten.add.Tensor"),
    "add_bcast_rank": C(lambda a, b: a + b, ((4,), (2, 3, 1)), "aten.add.Tensor"),
    "add_scalar": C(lambda a: a + 2.5, ((3, 4),), "aten.add.Tensor"),
    "add_alpha": C(lambda a, b: torch.add(a, b, alpha=0.5), ((3, 4), (4,)), "aten.add.Tensor"),
    "add_data": C(lambda a, x: x + a, ((4,),), "aten.add.Tensor", inputs=_data(3, 4)),
    "sub": C(lambda a, b: a - b, ((3, 4), (3, 4)), "aten.sub.Tensor"),
    "sub_alpha": C(lambda a, b: torch.sub(a, b, alpha=3), ((1, 4), (3, 1)), "aten.sub.Tensor"),
    "sub_scalar": C(lambda a: a - 1.5, ((3,),), "aten.sub.Tensor"),
    "rsub": C(lambda a: 1.0 - a, ((3, 4),), "aten.rsub.Scalar"),
    "rsub_tensor": C(lambda a, b: torch.rsub(a, b, alpha=2), ((3, 4), (4,)), "aten.rsub.Tensor"),
    "rsub_alpha": C(lambda a: torch.rsub(a, 2.0, alpha=3), ((3, 4),), "aten.rsub.Scalar"),
    "mul": C(lambda a, b: a * b, ((3, 4), (3, 4)), "aten.mul.Tensor"),
    "mul_bcast": C(lambda a, b: a * b, ((3, 1), (2, 1, 4)), "aten.mul.Tensor"),
    "mul_scalar": C(lambda a: a * -3.0, ((3, 4),), "aten.mul.Tensor"),
    "mul_self": C(lambda a: a * a, ((3, 4),), "aten.mul.Tensor"),
    "div": C(lambda a, b: a / b, ((3, 4), (3, 4)), "aten.div.Tensor", positive=True),
    "div_bcast": C(lambda a, b: a / b, ((4,), (3, 1)), "aten.div.Tensor", positive=True),
    "div_scalar": C(lambda a: a / 4.0, ((3, 4),), "aten.div.Tensor"),
    "masked_fill": C(lambda a: a.masked_fill(a > 0, -0.5), ((3, 4),), "aten.masked_fill.Scalar"),
    "masked_fill_bcast": C(lambda a, b: (a * b).masked_fill(b < 0, 2.0), ((3, 4), (4,)),
                           "aten.masked_fill.Scalar"),
    "masked_fill_bcast_x": C(lambda a, b: a.masked_fill(b > 0, 2.0) * b, ((1, 4), (3, 4)),
                             "aten.masked_fill.Scalar"),
    "neg": C(torch.neg, ((3, 4),), "aten.neg.default"),
    "exp": C(torch.exp, ((3, 4),), "aten.exp.default"),
    "log": C(torch.log, ((3, 4),), "aten.log.default", positive=True),
    "sqrt": C(torch.sqrt, ((3, 4),), "aten.sqrt.default", positive=True),
    "rsqrt": C(torch.rsqrt, ((3, 4),), "aten.rsqrt.default", positive=True),
    "tanh": C(torch.tanh, ((3, 4),), "aten.tanh.default"),
    "sigmoid": C(torch.sigmoid, ((3, 4),), "aten.sigmoid.default"),
    "relu": C(F.relu, ((3, 4),), "aten.relu.default"),
    "gelu": C(F.gelu, ((3, 4),), "aten.gelu.default"),
    "gelu_tanh": C(lambda a: F.gelu(a, approximate="tanh"), ((3, 4),), "aten.gelu.default"),
    "silu": C(F.silu, ((3, 4),), "aten.silu.default"),
    "pow2": C(lambda a: a**2, ((3, 4),), "aten.pow.Tensor_Scalar"),
    "pow3": C(lambda a: a**3, ((3, 4),), "aten.pow.Tensor_Scalar"),
    "pow_half": C(lambda a: a**0.5, ((3, 4),), "aten.pow.Tensor_Scalar", positive=True),
    "pow_neg": C(lambda a: a**-1.5, ((3, 4),), "aten.pow.Tensor_Scalar", positive=True),
    # views and layout
    "view": C(lambda a: a.view(2, 6), ((3, 4),), "aten.view.default"),
    "view_infer": C(lambda a: a.view(-1), ((3, 4),), "aten.view.default"),
    "reshape": C(lambda a: a.reshape(4, 3), ((3, 4),), "aten.reshape.default"),
    "unsqueeze": C(lambda a: a.unsqueeze(-1), ((3, 4),), "aten.unsqueeze.default"),
    "squeeze_dim": C(lambda a: a.squeeze(1), ((3, 1, 4),), "aten.squeeze.dim"),
    "squeeze_all": C(lambda a: a.squeeze(), ((3, 1, 4),), "aten.squeeze.default"),
    "squeeze_dims": C(lambda a: a.squeeze((0, 2)), ((1, 3, 1, 4),), "aten.squeeze.dims"),
    "flatten": C(lambda a: a.flatten(1), ((2, 3, 4),), "aten.flatten.using_ints"),
    "transpose": C(lambda a: a.transpose(0, -1), ((2, 3, 4),), "aten.transpose.int"),
    "t": C(lambda a: a.t(), ((3, 4),), "aten.t.default"),
    "permute": C(lambda a: a.permute(2, 0, 1), ((2, 3, 4),), "aten.permute.default"),
    "permute_neg": C(lambda a: a.permute(-1, 1, 0), ((2, 3, 4),), "aten.permute.default"),
    "expand": C(lambda a: a.expand(3, 4), ((1, 4),), "aten.expand.default"),
    "expand_rank": C(lambda a: a.expand(2, 3, -1), ((3, 1),), "aten.expand.default"),
    "split": C(lambda a: a.split(2, dim=1), ((3, 5),), "aten.split.Tensor"),
    "split_unused": C(lambda a: a.split(2)[1], ((5, 3),), "aten.split.Tensor"),
    "split_with_sizes": C(lambda a: a.split([1, 4], -1), ((3, 5),),
                          "aten.split_with_sizes.default"),
    "chunk": C(lambda a: a.chunk(3, 1), ((3, 6),), "aten.chunk.default"),
    "chunk_unused": C(lambda a: a.chunk(3, 1)[2], ((3, 6),), "aten.chunk.default"),
    "unbind": C(lambda a: a.unbind(1), ((3, 4),), "aten.unbind.int"),
    "unbind_unused": C(lambda a: a.unbind(0)[0], ((3, 4),), "aten.unbind.int"),
    "cat": C(lambda a, b: torch.cat([a, b]), ((2, 3), (1, 3)), "aten.cat.default"),
    "cat_neg_data": C(lambda a, b, x: torch.cat([a, x, b], -1), ((3, 2), (3, 1)),
                      "aten.cat.default", inputs=_data(3, 4)),
    "slice": C(lambda a: a[1:3], ((4, 3),), "aten.slice.Tensor"),
    "slice_neg_none_step": C(lambda a: a[:, -5::2], ((3, 7),), "aten.slice.Tensor"),
    "slice_neg_end": C(lambda a: a[:, 1:-1], ((3, 7),), "aten.slice.Tensor"),
    "slice_past_end": C(lambda a: a[:, 2:100:3], ((3, 7),), "aten.slice.Tensor"),
    "select": C(lambda a: a[:, 1], ((3, 4),), "aten.select.int"),
    "select_neg": C(lambda a: a[-1], ((3, 4),), "aten.select.int"),
    # the functional forms of writes (capture functionalizes `x[..] = v` into them)
    "copy_broadcast": C(lambda a, b: a.clone().copy_(b), ((3, 4), (4,)), "aten.copy.default"),
    "copy_from_f32": C(lambda a, b: a.clone().copy_(b.to(F32)), ((3, 4), (3, 4)),
                       "aten.copy.default"),
    "slice_scatter": C(lambda a, b: torch.slice_scatter(a, b, 1, 1, 7, 2), ((3, 7), (3, 3)),
                       "aten.slice_scatter.default"),
    "slice_scatter_default": C(lambda a, b: torch.slice_scatter(a, b), ((3, 4), (3, 4)),
                               "aten.slice_scatter.default"),
    "select_scatter": C(lambda a, b: torch.select_scatter(a, b, 0, -1), ((3, 4), (4,)),
                        "aten.select_scatter.default"),
    # reductions
    "sum": C(lambda a: a.sum(), ((3, 4),), "aten.sum.default"),
    "sum_dim": C(lambda a: a.sum(1), ((2, 3, 4),), "aten.sum.dim_IntList"),
    "sum_dims_neg": C(lambda a: a.sum((0, -1)), ((2, 3, 4),), "aten.sum.dim_IntList"),
    "sum_empty_dims": C(lambda a: a.sum(()), ((2, 3),), "aten.sum.dim_IntList"),
    "sum_dtype": C(lambda a: a.sum(dtype=F32), ((2, 3),), "aten.sum.default", tol=1e-6),
    "sum_keepdim": C(lambda a: a.sum(-1, keepdim=True), ((2, 3, 4),), "aten.sum.dim_IntList"),
    "mean": C(lambda a: a.mean(), ((3, 4),), "aten.mean.default"),
    "mean_dim": C(lambda a: a.mean(0), ((2, 3, 4),), "aten.mean.dim"),
    "mean_none": C(lambda a: a.mean(dim=None), ((2, 3),), "aten.mean.dim"),
    "mean_keepdim": C(lambda a: a.mean((1, 2), keepdim=True), ((2, 3, 4),), "aten.mean.dim"),
    # matmuls
    "linear": C(F.linear, ((3, 4), (5, 4), (5,)), "aten.linear.default"),
    "linear_nobias": C(F.linear, ((3, 4), (5, 4)), "aten.linear.default"),
    "linear_3d": C(F.linear, ((2, 3, 4), (5, 4), (5,)), "aten.linear.default"),
    "linear_3d_nobias": C(F.linear, ((2, 3, 4), (5, 4)), "aten.linear.default"),
    "linear_data": C(lambda w, b, x: F.linear(x, w, b), ((5, 4), (5,)), "aten.linear.default",
                     inputs=_data(2, 3, 4)),
    "mm": C(torch.mm, ((3, 4), (4, 5)), "aten.mm.default"),
    "bmm": C(torch.bmm, ((2, 3, 4), (2, 4, 5)), "aten.bmm.default"),
    "matmul": C(torch.matmul, ((3, 4), (4, 5)), "aten.matmul.default"),
    "matmul_3d_2d": C(torch.matmul, ((2, 3, 4), (4, 5)), "aten.matmul.default"),
    "matmul_2d_3d": C(torch.matmul, ((3, 4), (2, 4, 5)), "aten.matmul.default"),
    "matmul_bcast_batch": C(torch.matmul, ((2, 1, 3, 4), (3, 4, 5)), "aten.matmul.default"),
    "matmul_1d": C(torch.matmul, ((3, 4), (4,)), "aten.matmul.default", generic=True),
    "matmul_1d_left": C(torch.matmul, ((4,), (2, 4, 3)), "aten.matmul.default", generic=True),
    "addmm": C(torch.addmm, ((3, 5), (3, 4), (4, 5)), "aten.addmm.default"),
    "addmm_bcast_beta_alpha": C(lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
                                ((5,), (3, 4), (4, 5)), "aten.addmm.default"),
    # normalization, softmax, embedding, losses
    "layer_norm": C(lambda x, w, b: F.layer_norm(x, (4,), w, b), ((2, 3, 4), (4,), (4,)),
                    "aten.native_layer_norm.default"),
    "layer_norm_2d_shape": C(lambda x, w, b: F.layer_norm(x, (3, 4), w, b),
                             ((2, 3, 4), (3, 4), (3, 4)), "aten.native_layer_norm.default"),
    "layer_norm_no_affine": C(lambda x: F.layer_norm(x, (4,)), ((2, 3, 4),),
                              "aten.native_layer_norm.default"),
    "softmax": C(lambda a: a.softmax(-1), ((3, 4),), "aten._softmax.default"),
    "softmax_dim0": C(lambda a: F.softmax(a, 0), ((3, 4),), "aten._softmax.default"),
    "log_softmax": C(lambda a: a.log_softmax(-1), ((3, 4),), "aten._log_softmax.default"),
    "embedding": C(lambda w, i: F.embedding(i, w), ((6, 3),), "aten.embedding.default",
                   inputs=_ints(2, 4, high=6)),
    "embedding_padding_idx": C(lambda w, i: F.embedding(i, w, padding_idx=1), ((6, 3),),
                               "aten.embedding.default",
                               inputs=lambda: (torch.tensor([[0, 1, 4, 1], [1, 5, 0, 2]]),)),
    "embedding_scale_by_freq": C(lambda w, i: F.embedding(i, w, scale_grad_by_freq=True),
                                 ((6, 3),), "aten.embedding.default",
                                 inputs=lambda: (torch.tensor([[0, 1, 4, 1], [1, 5, 0, 1]]),)),
    "cross_entropy": C(F.cross_entropy, ((6, 5),), "aten.nll_loss_forward.default",
                       inputs=_ce_targets),
    "cross_entropy_sum": C(lambda x, t: F.cross_entropy(x, t, reduction="sum"), ((6, 5),),
                           "aten.nll_loss_forward.default", inputs=_ce_targets),
    "cross_entropy_none": C(lambda x, t: F.cross_entropy(x, t, reduction="none"), ((6, 5),),
                            "aten.nll_loss_forward.default", inputs=_ce_targets),
    "cross_entropy_weight_ignore0": C(
        lambda x, t, w: F.cross_entropy(x, t, weight=w, ignore_index=0), ((6, 5),),
        "aten.nll_loss_forward.default",
        inputs=lambda: (torch.tensor([0, 1, 4, 0, 2, 3]), torch.rand(5, dtype=F64) + 0.5)),
    "cross_entropy_1d": C(F.cross_entropy, ((5,),), "aten.nll_loss_forward.default",
                          inputs=lambda: (torch.tensor(3),)),
    "cross_entropy_3d": C(F.cross_entropy, ((3, 5, 2),), "aten.cross_entropy_loss.default",
                          inputs=_ints(3, 2), generic=True),
    "cross_entropy_smoothing": C(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
                                 ((6, 5),), "aten.cross_entropy_loss.default",
                                 inputs=_ce_targets, generic=True),
    "sdpa": C(F.scaled_dot_product_attention, ((2, 2, 5, 4),) * 3,
              "aten._scaled_dot_product_flash_attention_for_cpu.default"),
    "sdpa_causal_scale": C(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
        ((2, 2, 5, 4),) * 3, "aten._scaled_dot_product_flash_attention_for_cpu.default"),
    # convolution and pooling
    "conv2d": C(lambda w, b, x: F.conv2d(x, w, b, stride=2, padding=1, groups=2),
                ((4, 1, 3, 3), (4,)), "aten.conv2d.default", inputs=_data(2, 2, 7, 7)),
    "conv2d_nobias": C(lambda w, x: F.conv2d(x, w, None, stride=2, padding=1, groups=2),
                       ((4, 1, 3, 3),), "aten.conv2d.default", inputs=_data(2, 2, 6, 6)),
    "conv2d_input_grad": C(lambda x, w: F.conv2d(x, w, padding=(1, 0), dilation=2),
                           ((1, 2, 6, 6), (3, 2, 2, 2)), "aten.conv2d.default"),
    "max_pool2d": C(lambda a: F.max_pool2d(a, 2), ((2, 3, 6, 6),),
                    "aten.max_pool2d_with_indices.default"),
    "max_pool2d_pad": C(lambda a: F.max_pool2d(a, 3, stride=2, padding=1), ((2, 3, 7, 7),),
                        "aten.max_pool2d_with_indices.default"),
    "max_pool2d_ceil_dilation": C(lambda a: F.max_pool2d(a, 2, 2, 0, 2, ceil_mode=True),
                                  ((1, 2, 7, 7),), "aten.max_pool2d_with_indices.default"),
    "avg_pool2d": C(lambda a: F.avg_pool2d(a, 2), ((2, 3, 6, 6),), "aten.avg_pool2d.default"),
    "avg_pool2d_pad": C(lambda a: F.avg_pool2d(a, 3, 2, 1, count_include_pad=False),
                        ((2, 3, 7, 7),), "aten.avg_pool2d.default"),
    "avg_pool2d_divisor_ceil": C(lambda a: F.avg_pool2d(a, 2, ceil_mode=True, divisor_override=3),
                                 ((1, 2, 5, 5),), "aten.avg_pool2d.default"),
    "adaptive_avg_pool2d": C(lambda a: F.adaptive_avg_pool2d(a, 2), ((2, 3, 6, 6),),
                             "aten._adaptive_avg_pool2d.default"),
    "adaptive_avg_pool2d_uneven": C(lambda a: F.adaptive_avg_pool2d(a, (3, 2)), ((2, 3, 7, 5),),
                                    "aten._adaptive_avg_pool2d.default"),
    # identity-like
    "clone": C(torch.clone, ((3, 4),), "aten.clone.default"),
    "contiguous": C(lambda a: a.t().contiguous(), ((3, 4),), "aten.contiguous.default"),
    "alias": C(torch.ops.aten.alias.default, ((3, 4),), "aten.alias.default"),
    "unsafe_view": C(lambda a: torch.ops.aten._unsafe_view.default(a, (2, 6)), ((3, 4),),
                     "aten._unsafe_view.default"),
    "to_copy": C(lambda a: torch.ops.aten._to_copy.default(a, dtype=F32), ((3, 4),),
                 "aten._to_copy.default"),
    "to_dtype": C(lambda a: a.to(F32), ((3, 4),), "aten.to.dtype"),
}


def _grouped_mm(x, w, offs):
    import transformers.integrations.moe  # noqa: F401 - registers the op (optional extra)

    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


# known custom ops, where their library is installed: transformers' grouped
# matmul (its MoE experts), rows 0-2 to expert 0, 3-4 to expert 1, 5 to expert 2
CUSTOM = {"grouped_mm": C(_grouped_mm, ((6, 4), (3, 4, 5)),
                          "transformers.grouped_mm_fallback.default",
                          inputs=lambda: (torch.tensor([3, 5, 6], dtype=torch.int32),))}
try:
    import transformers  # noqa: F401
except ImportError:
    CUSTOM = {}
CASES |= CUSTOM


@pytest.mark.parametrize("name", list(CASES))
def test_rule_matches_eager(name):
    case = CASES[name]
    torch.manual_seed(0)
    inputs = case.inputs()
    module = OpModule(case)
    module.add_cotangents(*inputs)
    step, state, loss = train_one_step(module, inputs)
    assert_rule_used(step, case.kind, case.generic)
    want = eager_one_step(module, inputs)
    assert math.isclose(loss, want, rel_tol=case.tol, abs_tol=case.tol)
    assert_grads_match(module, state, case.tol)


def test_every_exact_rule_has_a_case():
    covered = {c.kind for c in CASES.values()} | {"aten.native_dropout.default",
                                                 "aten._native_batch_norm_legit_functional.default"}
    assert exact_kinds() <= covered, sorted(exact_kinds() - covered)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_dropout_matches_eager_drawing_the_same_mask(p):
    """Capture makes dropout a `meshplan.dropout` drawing from the
    counter-based generator; eager under `SameMasks` draws the same mask
    (step 0, micro-batch 0: the one-step executor's), so the gradients are
    equal bit for bit, with its exact rule (no vjp)."""
    case = Case(lambda a: F.dropout(a, p, True), ((16, 8),), DROPOUT)
    torch.manual_seed(0)
    module = OpModule(case)
    module.add_cotangents()
    step, state, loss = train_one_step(module, ())
    with SameMasks().at(0, 0):
        want = eager_one_step(module, ())
    kinds = {op.kind for op in step.ops}
    assert not any("dropout" in k for k in kinds) if p == 0 else case.kind in kinds
    assert "meshplan.vjp" not in kinds
    assert loss == want
    assert_grads_match(module, state, 0.0)
    if p:  # the mask itself: zero where dropped, cot / (1 - p) where kept
        grad, cot = state["p0@grad"], module.cot0
        kept = counter_rng.keep_mask(counter_rng.whole(cot.shape), tuple(cot.shape), p,
                                     counter_rng.RandomCounter().stream(0, tuple(cot.shape)))
        assert 0 < kept.sum() < kept.numel()
        assert torch.equal(grad == 0, ~kept)
        torch.testing.assert_close(grad[kept], cot[kept] / (1 - p), rtol=1e-12, atol=0)


def test_dropout_off_in_eval_is_identity():
    module = nn.Sequential(nn.Dropout(0.5))
    case = Case(lambda a: module(a), ((4, 3),), "aten.mul.Tensor")
    module.eval()
    torch.manual_seed(0)
    m = OpModule(case)
    m.add_cotangents()
    m.eval()
    step, state, _ = train_one_step(m, ())
    assert not any("dropout" in op.kind for op in step.ops)
    eager_one_step(m, ())
    assert_grads_match(m, state, 1e-12)


class _BatchNormModule(nn.Module):
    def __init__(self, affine: bool):
        super().__init__()
        self.x = nn.Parameter(torch.randn(3, 4, 5, 5, dtype=F64))
        self.bn = nn.BatchNorm2d(4, affine=affine, momentum=0.2, dtype=F64)
        if affine:
            with torch.no_grad():
                self.bn.weight.uniform_(0.5, 1.5)
                self.bn.bias.normal_()
        self.bn.running_mean.normal_()
        self.register_buffer("cot", torch.randn(3, 4, 5, 5, dtype=F64))

    def forward(self):
        return (self.bn(self.x) * self.cot).sum()


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_train_grads_and_running_stats(affine):
    torch.manual_seed(0)
    module = _BatchNormModule(affine)
    step, state, loss = train_one_step(module, ())
    assert_rule_used(step, "aten._native_batch_norm_legit_functional.default", generic=False)
    want = eager_one_step(module, ())
    assert math.isclose(loss, want, rel_tol=1e-10, abs_tol=1e-10)
    assert_grads_match(module, state, 1e-10)
    for name, buf in module.named_buffers():
        if name.startswith("bn."):
            torch.testing.assert_close(state[name], buf, rtol=1e-12, atol=0, msg=name)
    assert int(state["bn.num_batches_tracked"]) == 1
