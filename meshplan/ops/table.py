"""The op rule table: kind -> `OpRule`, with the generic rule as default.

Invariants: `rule_for(kind)` always answers for any aten kind; kinds listed
here are exact (hand-written gradient, cost), every other aten op gets the
generic rule (meta-kernel inference, `torch.func.vjp` gradient), and so
does a custom op with a fake kernel and an autograd formula
(`ops/resolve.py`). Every meshplan kind (`ir/kinds.py`) has its own rule
here, with its category; any other kind is refused.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache, partial
from typing import Any, Callable

import torch

from meshplan.errors import CaptureError
from meshplan.ir import DType, Op, Ref, TensorMeta
from meshplan.ir import kinds as k
from meshplan.ir.choices import OpPrecision, OpRecompute
from meshplan.ops import cost, kernels
from meshplan.ops import grads_nn as nn
from meshplan.ops import grads_pointwise as pw
from meshplan.ops import grads_shape as sh
from meshplan.ops import random_ops as rnd
from meshplan.ops import routed_experts as moe
from meshplan.ops.canonical import CANONICAL
from meshplan.ops.device_kernels import DEVICES, Values
from meshplan.ops.generic import vjp_grad, vjp_infer, vjp_kernel, vjp_sbp
from meshplan.ops.policy import PRECISION, recompute_class
from meshplan.ops.resolve import AUTOGRAD_FORMULA, custom_op_missing, is_custom, resolve_op
from meshplan.ops.rule import Category, OpRule
from meshplan.ops.sbp_table import sbp_rule

_GRADS = {
    # pointwise
    "aten.add.Tensor": pw.add_grad,
    "aten.sub.Tensor": pw.sub_grad,
    "aten.rsub.Scalar": pw.rsub_grad,
    "aten.rsub.Tensor": pw.rsub_grad,
    "aten.mul.Tensor": pw.mul_grad,
    "aten.div.Tensor": pw.div_grad,
    "aten.neg.default": pw.neg_grad,
    "aten.exp.default": pw.exp_grad,
    "aten.log.default": pw.log_grad,
    "aten.sqrt.default": pw.sqrt_grad,
    "aten.rsqrt.default": pw.rsqrt_grad,
    "aten.tanh.default": pw.tanh_grad,
    "aten.sigmoid.default": pw.sigmoid_grad,
    "aten.relu.default": pw.relu_grad,
    "aten.gelu.default": pw.gelu_grad,
    "aten.silu.default": pw.silu_grad,
    "aten.pow.Tensor_Scalar": pw.pow_scalar_grad,
    "aten.clone.default": pw.identity_grad,
    "aten.contiguous.default": pw.identity_grad,
    "aten.alias.default": pw.identity_grad,
    "aten._to_copy.default": pw.to_copy_grad,
    "aten.masked_fill.Scalar": pw.masked_fill_grad,
    "aten.to.dtype": pw.to_copy_grad,
    # layout and views
    "aten.view.default": sh.view_grad,
    "aten.reshape.default": sh.view_grad,
    "aten._unsafe_view.default": sh.view_grad,
    "aten.unsqueeze.default": sh.view_grad,
    "aten.squeeze.default": sh.view_grad,
    "aten.squeeze.dim": sh.view_grad,
    "aten.squeeze.dims": sh.view_grad,
    "aten.flatten.using_ints": sh.view_grad,
    "aten.transpose.int": sh.transpose_grad,
    "aten.t.default": sh.t_grad,
    "aten.permute.default": sh.permute_grad,
    "aten.expand.default": sh.expand_grad,
    "aten.split.Tensor": sh.split_grad,
    "aten.split_with_sizes.default": sh.split_grad,
    "aten.chunk.default": sh.split_grad,
    "aten.unbind.int": sh.split_grad,
    "aten.cat.default": sh.cat_grad,
    "aten.slice.Tensor": sh.slice_grad,
    "aten.select.int": sh.select_grad,
    "aten.copy.default": sh.copy_grad,
    "aten.slice_scatter.default": sh.slice_scatter_grad,
    "aten.select_scatter.default": sh.select_scatter_grad,
    # reductions
    "aten.sum.default": sh.sum_grad,
    "aten.sum.dim_IntList": sh.sum_grad,
    "aten.mean.default": sh.mean_grad,
    "aten.mean.dim": sh.mean_grad,
    # neural-network ops
    "aten.linear.default": nn.linear_grad,
    "aten.mm.default": nn.mm_grad,
    "aten.bmm.default": nn.mm_grad,
    "aten.matmul.default": nn.matmul_grad,
    "aten.addmm.default": nn.addmm_grad,
    "aten.native_layer_norm.default": nn.layer_norm_grad,
    "aten._softmax.default": nn.softmax_grad,
    "aten._log_softmax.default": nn.softmax_grad,
    "aten.embedding.default": nn.embedding_grad,
    "aten.nll_loss_forward.default": nn.nll_loss_grad,
    "aten.native_dropout.default": nn.dropout_grad,
    "aten._scaled_dot_product_flash_attention_for_cpu.default": nn.sdpa_cpu_grad,
    "aten.conv2d.default": nn.conv2d_grad,
    "aten._native_batch_norm_legit_functional.default": nn.batch_norm_grad,
    "aten.max_pool2d_with_indices.default": nn.max_pool2d_grad,
    "aten.avg_pool2d.default": nn.avg_pool2d_grad,
    "aten._adaptive_avg_pool2d.default": nn.adaptive_avg_pool2d_grad,
    # known custom ops
    nn.GROUPED_MM: nn.grouped_mm_grad,
}

_FLOPS = {
    "aten.linear.default": cost.linear_flops,
    "aten.mm.default": cost.mm_flops,
    "aten.bmm.default": cost.mm_flops,
    "aten.matmul.default": cost.mm_flops,
    "aten.addmm.default": cost.addmm_flops,
    "aten.conv2d.default": cost.conv2d_flops,
    "aten._scaled_dot_product_flash_attention_for_cpu.default": cost.sdpa_flops,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": cost.backward_of(
        cost.sdpa_flops, 2.5
    ),
    "aten.convolution_backward.default": cost.backward_of(cost.conv2d_flops),
    nn.GROUPED_MM: cost.mm_flops,  # (tokens, in) by (experts, in, out): each token one expert
    nn.GROUPED_MM_BACKWARD: lambda a: 2.0 * cost.mm_flops(a[:2]),  # (x, w, offs, grad)
}

_TEMP = {
    "aten.conv2d.default": cost.conv2d_temp,
    "aten.convolution_backward.default": lambda a: cost.conv2d_temp(a[1:]),
    "aten._scaled_dot_product_flash_attention_for_cpu.default": cost.sdpa_temp,
}

# Shape-carrying arguments, localized per rank (see `OpRule.shape_args`).
_SHAPE_ARGS = {
    "aten.view.default": ((1, 0),),
    "aten.reshape.default": ((1, 0),),
    "aten._unsafe_view.default": ((1, 0),),
    "aten.expand.default": ((1, 0),),
    "aten.new_zeros.default": ((1, 0),),
    "aten.new_empty.default": ((1, 0),),
    "aten.slice_backward.default": ((1, 0),),
    "aten.select_backward.default": ((1, 0),),
    "aten.zeros.default": ((0, 0),),
    "aten.full.default": ((0, 0),),
}

# Ops whose outputs carry no gradient (integer results, statistics).
_NONDIFF = {
    "aten.arange.start", "aten.arange.default", "aten.zeros_like.default",
    "aten.ones_like.default", "aten.full_like.default", "aten.eq.Tensor", "aten.ne.Scalar",
    "aten.argmax.default", "aten.detach.default", "aten.lift_fresh_copy.default",
    # read only their input's dtype and device
    "aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default",
    "aten.new_empty.default",
    nn.GROUPED_MM_BACKWARD,  # a gradient op: never differentiated itself
}
# Ops with float outputs that carry no gradient: the outputs that do (nll_loss's
# total weight is a count; a gradient for it would be dead code).
_GRAD_OUTPUTS = {"aten.nll_loss_forward.default": (0,), "aten.nll_loss2d_forward.default": (0,)}


def _meshplan_rule(kind: str, kernel: Callable, category: Category = Category.COMPUTE,
                   **facts: Any) -> OpRule:
    """A meshplan op: no gradient of its own (autodiff never differentiates it)."""
    return OpRule(kind, kernel, category, differentiable=False, **facts)


def _scalar(args, kwargs):
    """A float32 scalar (a squared norm)."""
    return (TensorMeta((), DType("float32")),)


def _boxing_rule(kind: str, category: Category) -> OpRule:
    """A boxing op: on the logical tensor, the identity; its distributed
    kernel is chosen by lowering and bound by the runtime. Its output is
    kept, never recomputed: communication is not redone."""
    return _meshplan_rule(kind, kernels.boxing_identity, category,
                          infer=lambda a, kw: (a[0],), recompute=OpRecompute.KEEP)


_MESHPLAN_KINDS = {rule.kind: rule for rule in (
    _meshplan_rule(k.GRAD_SUM, kernels.grad_sum, sums=True),
    _meshplan_rule(k.ACCUMULATE_GRAD, kernels.accumulate_grad, infer=lambda a, kw: (a[1],)),
    _meshplan_rule(k.VJP, vjp_kernel, infer=vjp_infer),
    _meshplan_rule(k.SGD, kernels.sgd_step, Category.OPTIMIZER,
                   infer=lambda a, kw: (a[0], a[0]), batched=kernels.sgd_multi,
                   fused_batched=True, batched_temp=kernels.sgd_temp),
    _meshplan_rule(k.ADAMW, kernels.adamw_step, Category.OPTIMIZER,
                   infer=lambda a, kw: (a[0], a[2], a[3], a[4]), batched=kernels.adamw_multi,
                   fused_batched=True, batched_temp=kernels.adamw_temp),
    _meshplan_rule(k.GRAD_SQ, kernels.grad_sq, infer=_scalar, temp_bytes=kernels.grad_sq_temp),
    _meshplan_rule(k.SQ_SUM, kernels.sq_sum, infer=_scalar),
    _meshplan_rule(k.CLIP_COEF, kernels.clip_coef, infer=lambda a, kw: (a[0], a[0])),
    OpRule(k.DROPOUT, rnd.dropout_kernel, grad=nn.dropout_grad, infer=rnd.dropout_infer,
           grad_outputs=(0,)),
    OpRule(k.ROUTED_EXPERTS, moe.routed_experts, grad=moe.grad, infer=moe.infer,
           flops=moe.flops, data_shapes=True),
    _meshplan_rule(k.ROUTED_EXPERTS_BACKWARD, moe.routed_experts_backward,
                   infer=moe.infer_backward, flops=moe.flops_backward, data_shapes=True),
    _meshplan_rule(k.RANDOM_LIKE, rnd.random_like_kernel, infer=rnd.random_like_infer),
    _meshplan_rule(k.RANDOM, rnd.random_kernel, infer=rnd.random_infer),
    _boxing_rule(k.ALL_REDUCE, Category.COLLECTIVE),
    _boxing_rule(k.REDUCE_SCATTER, Category.COLLECTIVE),
    _boxing_rule(k.ALL_GATHER, Category.COLLECTIVE),
    _boxing_rule(k.ALL_TO_ALL, Category.COLLECTIVE),
    _boxing_rule(k.LOCAL_SLICE, Category.LOCAL_SLICE),
    _boxing_rule(k.LOCAL_PARTIAL, Category.LOCAL_SLICE),
    _boxing_rule(k.TRANSFER, Category.TRANSFER),
)}


# CompositeImplicit ops whose schema hides that they update buffers in place
_HIDDEN_MUTATION = frozenset({"aten.batch_norm.default", "aten.instance_norm.default"})


def _sbp_of(kind: str):
    return rule_for(kind).sbp


@cache
def rule_for(kind: str) -> OpRule:
    """The rule of `kind`: exact if listed, else the generic rule."""
    if kind in _MESHPLAN_KINDS:
        return replace(_MESHPLAN_KINDS[kind], sbp=partial(vjp_sbp, _sbp_of) if kind == k.VJP
                       else sbp_rule(kind))
    if kind.startswith(k.PREFIX):
        raise CaptureError(f"op {kind!r} is neither an aten op nor a meshplan op")
    missing = () if not is_custom(kind) else tuple(
        m for m in custom_op_missing(kind) if kind not in _NONDIFF or m != AUTOGRAD_FORMULA)
    if missing:
        raise CaptureError(
            f"custom op {kind!r} has no {' and no '.join(missing)} (meshplan shapes a custom "
            "op by the one and differentiates it by the other); register it with "
            "torch.library.register_fake or register_autograd")
    kernel = resolve_op(kind)
    canonical = CANONICAL.get(kind)
    grad = _GRADS.get(kind)
    return OpRule(
        kind=kind,
        kernel=kernel,
        grad=vjp_grad if grad is None else partial(_real_only, grad),
        canonical=canonical,
        flops=_FLOPS.get(kind),
        temp_bytes=_TEMP.get(kind),
        exact=grad is not None or kind in _NONDIFF,
        differentiable=kind not in _NONDIFF,
        grad_outputs=_GRAD_OUTPUTS.get(kind),
        sbp=sbp_rule(kind),
        shape_args=_SHAPE_ARGS.get(kind, ()),
        precision=PRECISION.get(kind, OpPrecision.PROMOTE),
        recompute=recompute_class(kind),
        devices=DEVICES.get(kind, ()),
        mutates=kind in _HIDDEN_MUTATION or _schema_mutates(kernel),
        returns_list=_schema_returns_list(kernel),
    )


def _real_only(grad: Callable, e, op: Op, gouts, needs):
    """A hand-written gradient rule (`_GRADS`) is for real tensors. On a
    complex one (a rotary embedding's product with its complex frequencies)
    torch differentiates the op (`vjp_grad`): its rules take the conjugates
    (the gradient of a * b to a is g * conj(b)), which `g * b` is not."""
    values = [*op.refs(), *(o for o in op.outputs if o >= 0)]
    if any(e.meta(Ref(v)).dtype.torch.is_complex for v in values):
        return vjp_grad(e, op, gouts, needs)
    return grad(e, op, gouts, needs)


def _schema_mutates(kernel) -> bool:
    """Whether an aten overload's schema writes an argument (`Tensor(a!)`)."""
    schema = getattr(kernel, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _schema_returns_list(kernel) -> bool:
    """Whether an op's schema returns one list of tensors (`-> Tensor[]`)."""
    schema = getattr(kernel, "_schema", None)
    return bool(schema is not None and len(schema.returns) == 1
                and isinstance(schema.returns[0].type, torch.ListType))


def physical_kernel(op: Op, values: Values, device_type: str) -> str:
    """The kernel `op` runs as on `device_type`: "" for its own kind, else the
    name the rule's chooser gives (`ops/device_kernels.py`)."""
    for device, choose in rule_for(op.kind).devices:
        if device == device_type:
            return choose(op, values)
    return ""


def exact_kinds() -> frozenset[str]:
    """Kinds with exact (hand-written) gradient rules."""
    return frozenset(_GRADS)


def meshplan_kinds() -> frozenset[str]:
    """The kinds of meshplan's own ops (every other kind is an aten op)."""
    return frozenset(_MESHPLAN_KINDS)
