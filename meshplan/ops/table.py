"""The op rule table: kind -> `OpRule`, with the generic rule as default.

Invariant: `rule_for(kind)` always answers for any aten kind; kinds listed
here are exact (hand-written gradient, cost), every other aten op gets the
generic rule (meta-kernel inference, `torch.func.vjp` gradient).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from meshplan.errors import CaptureError
from meshplan.ops import cost, kernels
from meshplan.ops import grads_nn as nn
from meshplan.ops import grads_pointwise as pw
from meshplan.ops import grads_shape as sh
from meshplan.ops.canonical import CANONICAL, functionalize
from meshplan.ops.device_kernels import DEVICES
from meshplan.ops.generic import vjp_grad, vjp_infer, vjp_kernel
from meshplan.ops.policy import PRECISION, recompute_class
from meshplan.ops.resolve import resolve_aten
from meshplan.ops.rule import OpRule
from meshplan.ops.sbp_table import SBP, replicated_rule

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
}

_TEMP = {
    "aten.conv2d.default": cost.conv2d_temp,
    "aten.convolution_backward.default": lambda a: cost.conv2d_temp(a[1:]),
    "aten._scaled_dot_product_flash_attention_for_cpu.default": cost.sdpa_temp,
}

# Ops whose outputs carry no gradient (integer results, statistics).
# Shape-carrying arguments, localized per rank (see `OpRule.shape_args`).
_SHAPE_ARGS = {
    "aten.view.default": ((1, 0),),
    "aten.reshape.default": ((1, 0),),
    "aten._unsafe_view.default": ((1, 0),),
    "aten.expand.default": ((1, 0),),
    "aten.new_zeros.default": ((1, 0),),
    "aten.slice_backward.default": ((1, 0),),
    "aten.select_backward.default": ((1, 0),),
    "aten.zeros.default": ((0, 0),),
    "aten.full.default": ((0, 0),),
}

_NONDIFF = {
    "aten.arange.start", "aten.arange.default", "aten.zeros_like.default",
    "aten.ones_like.default", "aten.full_like.default", "aten.eq.Tensor",
    "aten.argmax.default", "aten.detach.default", "aten.lift_fresh_copy.default",
}

_MESHPLAN_KINDS = {
    "meshplan.grad_sum": OpRule("meshplan.grad_sum", kernels.grad_sum, differentiable=False),
    "meshplan.accumulate_grad": OpRule(
        "meshplan.accumulate_grad", kernels.accumulate_grad, differentiable=False,
        infer=lambda a, k: (a[1],),
    ),
    "meshplan.vjp": OpRule("meshplan.vjp", vjp_kernel, infer=vjp_infer, differentiable=False),
    "meshplan.sgd": OpRule(
        "meshplan.sgd", kernels.sgd_step, differentiable=False,
        infer=lambda a, k: (a[0], a[0]), batched=kernels.sgd_multi,
    ),
    "meshplan.adamw": OpRule(
        "meshplan.adamw", kernels.adamw_step, differentiable=False,
        infer=lambda a, k: (a[0], a[2], a[3], a[4]), batched=kernels.adamw_multi,
    ),
}


# The ops the boxing pass inserts (collectives, slices, stage transfers).
BOXING_KINDS = ("meshplan.all_reduce", "meshplan.reduce_scatter", "meshplan.all_gather",
                "meshplan.all_to_all", "meshplan.local_slice", "meshplan.transfer")

for _kind in BOXING_KINDS:
    _MESHPLAN_KINDS[_kind] = OpRule(
        _kind, kernels.boxing_identity, differentiable=False,
        infer=lambda a, k: (a[0],), recompute="keep",  # communication is not redone
    )


@cache
def rule_for(kind: str) -> OpRule:
    """The rule of `kind`: exact if listed, else the generic rule."""
    if kind in _MESHPLAN_KINDS:
        return replace(_MESHPLAN_KINDS[kind], sbp=SBP.get(kind, replicated_rule))
    if not kind.startswith("aten."):
        raise CaptureError(f"op {kind!r} is neither an aten op nor a meshplan op")
    kernel = resolve_aten(kind)
    canonical = CANONICAL.get(kind)
    if canonical is None and kind.split(".")[1].endswith("_"):
        canonical = _functional_form(kind)
    grad = _GRADS.get(kind)
    return OpRule(
        kind=kind,
        kernel=kernel,
        grad=grad if grad is not None else vjp_grad,
        canonical=canonical,
        flops=_FLOPS.get(kind),
        temp_bytes=_TEMP.get(kind),
        exact=grad is not None or kind in _NONDIFF,
        differentiable=kind not in _NONDIFF,
        sbp=SBP.get(kind, replicated_rule),
        shape_args=_SHAPE_ARGS.get(kind, ()),
        precision=PRECISION.get(kind, ""),
        recompute=recompute_class(kind),
        devices=DEVICES.get(kind, ()),
    )


def _functional_form(kind: str):
    """`aten.relu_.default` -> a rewrite to `aten.relu.default`, if it exists."""
    _ns, name, overload = kind.split(".")
    functional = f"aten.{name[:-1]}.{overload}"
    try:
        resolve_aten(functional)
    except CaptureError:
        return None
    return functionalize(functional)


def physical_kernel(op, values, device_type: str) -> str:
    """The kernel `op` runs as on `device_type`: "" for its own kind, else the
    name the rule's chooser gives (`ops/device_kernels.py`)."""
    for device, choose in rule_for(op.kind).devices:
        if device == device_type:
            return choose(op, values)
    return ""


def exact_kinds() -> frozenset[str]:
    """Kinds with exact (hand-written) gradient rules."""
    return frozenset(_GRADS)
