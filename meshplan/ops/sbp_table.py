"""Kind -> SBP rule (`sbp_rule`): the table's; else, for an aten op torch
tags `pointwise` (and does not draw random numbers: those are
`random_ops`'), the pointwise rule; else every tensor replicated (always
correct, and slow: a split activation is gathered whole to meet it).

Invariant: torch's `pointwise` tag means every tensor argument broadcasts
against the others elementwise, which is all the pointwise rule assumes;
the table lists the untagged kinds that are pointwise too, and the kinds
whose rule needs more (linearity, a dim).
"""

from __future__ import annotations

from functools import cache

import torch

from meshplan.ir.kinds import (
    ACCUMULATE_GRAD,
    ADAMW,
    DROPOUT,
    GRAD_SQ,
    GRAD_SUM,
    RANDOM_LIKE,
    ROUTED_EXPERTS,
    ROUTED_EXPERTS_BACKWARD,
    SGD,
    SQ_SUM,
)
from meshplan.ops import random_ops as rnd
from meshplan.ops import routed_experts as moe
from meshplan.ops import sbp_nn as nn
from meshplan.ops import sbp_rules as r
from meshplan.ops.sbp_sig import Outs, SbpRule, SbpSig, replicated, tensors

_LINEAR_IN_0 = r.pointwise((0,))

SBP: dict[str, SbpRule] = {
    "aten.add.Tensor": r.additive,
    "aten.sub.Tensor": r.additive,
    "aten.rsub.Tensor": r.additive,
    "aten.rsub.Scalar": r.pointwise(),  # number - x: not linear in x
    "aten.mul.Tensor": r.pointwise((0, 1)),
    "aten.div.Tensor": _LINEAR_IN_0,
    "aten.neg.default": _LINEAR_IN_0,
    "aten.clone.default": _LINEAR_IN_0,
    "aten.contiguous.default": _LINEAR_IN_0,
    "aten.alias.default": _LINEAR_IN_0,
    "aten._to_copy.default": _LINEAR_IN_0,
    "aten.to.dtype": _LINEAR_IN_0,
    "aten.detach.default": _LINEAR_IN_0,
    "aten.multiply.Tensor": r.pointwise((0, 1)),
    **{f"aten.{k}": r.pointwise() for k in (  # pointwise, untagged by torch
        "where.ScalarOther", "where.ScalarSelf", "where.Scalar", "__and__.Tensor",
        "__or__.Tensor", "__xor__.Tensor", "log_sigmoid.default")},
    "aten.gelu_backward.default": _LINEAR_IN_0,
    "aten.tanh_backward.default": _LINEAR_IN_0,
    "aten.sigmoid_backward.default": _LINEAR_IN_0,
    "aten.threshold_backward.default": _LINEAR_IN_0,
    "aten.silu_backward.default": _LINEAR_IN_0,
    "aten.native_dropout_backward.default": _LINEAR_IN_0,
    **{f"aten.{k}.default": r.pointwise() for k in (
        "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu")},
    "aten.pow.Tensor_Scalar": r.pointwise(),
    **{f"aten.{k}": r.pointwise() for k in (
        "ne.Scalar", "eq.Scalar", "lt.Scalar", "le.Scalar", "gt.Scalar", "ge.Scalar",
        "clamp.default", "clamp_min.default", "clamp_max.default", "abs.default")},
    **{f"aten.{k}.default": r.meta_only for k in ("new_zeros", "new_ones", "new_full",
                                                   "new_empty")},
    "aten.one_hot.default": r.keeps_dims,
    "aten.topk.default": r.along_dim(2, default_dim=-1, linear=False),
    "aten.cumsum.default": r.along_dim(1),
    "aten.zeros_like.default": r.like,
    "aten.ones_like.default": r.like,
    "aten.full_like.default": r.like,
    **{k: r.view for k in (
        "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
        "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
        "aten.squeeze.default", "aten.flatten.using_ints")},
    "aten.transpose.int": r.transpose,
    "aten.t.default": r.t,
    "aten.permute.default": r.permute,
    "aten.expand.default": r.expand,
    "aten.split.Tensor": r.along_dim(2),
    "aten.split_with_sizes.default": r.along_dim(2),
    "aten.chunk.default": r.along_dim(2),
    "aten.unbind.int": r.along_dim(1, removes_dim=True),
    "aten.cat.default": r.cat,
    "aten.concatenate.default": r.cat,
    "aten.scatter.value": r.scatter_value,
    "aten.repeat_interleave.self_int": r.repeat_interleave,
    "aten.stack.default": r.stack,
    "aten.broadcast_tensors.default": r.broadcast,
    "aten.mse_loss.default": r.elementwise_loss,
    "aten.gather.default": r.gather,
    "aten.sort.default": r.along_dim(1, default_dim=-1, linear=False),
    "aten.slice.Tensor": r.along_dim(1),
    "aten.select.int": r.along_dim(1, removes_dim=True),
    "aten.slice_backward.default": r.along_dim(2),
    "aten.slice_scatter.default": r.along_dim(2),
    "aten.select_backward.default": r.select_backward,
    "aten.tensor_split.indices": r.along_dim(2),
    "aten.pad.default": r.padded,
    "aten.constant_pad_nd.default": r.padded,
    "aten.select_scatter.default": r.select_scatter,
    "aten.copy.default": r.pointwise((1,)),  # the output is src, broadcast
    "aten.masked_fill.Scalar": r.pointwise(),
    "aten.masked_fill.Tensor": r.pointwise(),
    "aten._softmax.default": r.along_dim(1, linear=False),
    "aten._log_softmax.default": r.along_dim(1, linear=False),
    "aten._softmax_backward_data.default": r.along_dim(2, linear=False),
    "aten._log_softmax_backward_data.default": r.along_dim(2, linear=False),
    "aten.sum.default": r.reduction("sum"),
    "aten.sum.dim_IntList": r.reduction("sum"),
    "aten.mean.default": r.reduction("mean"),
    "aten.mean.dim": r.reduction("mean"),
    "aten.amax.default": r.reduction("max"),
    "aten.linalg_vector_norm.default": r.reduces_whole(2, 3),
    "aten.logsumexp.default": r.reduces_whole(1, 2),
    "aten.max.dim": r.reduces_whole(1, 2),
    "aten.var.correction": r.reduces_whole(1, 3),
    "aten.tril.default": r.last_two,
    "aten.triu.default": r.last_two,
    "aten.expand_as.default": _LINEAR_IN_0,
    "aten.view_as_complex.default": r.complex_view,
    "aten.view_as_real.default": r.complex_view,
    "aten.linear.default": nn.linear,
    "aten.baddbmm.default": r.baddbmm,
    "aten.einsum.default": nn.einsum,
    "aten.mm.default": nn.matmul,
    "aten.bmm.default": nn.matmul,
    "aten.matmul.default": nn.matmul,
    "aten.addmm.default": nn.addmm,
    "aten.native_layer_norm.default": nn.layer_norm,
    "aten.native_layer_norm_backward.default": nn.layer_norm_backward,
    "aten.embedding.default": nn.embedding,
    "aten.index_select.default": nn.index_select,
    "aten.embedding_dense_backward.default": nn.embedding_backward,
    "aten.nll_loss_forward.default": nn.nll_loss,
    "aten.nll_loss_backward.default": nn.nll_loss_backward,
    "aten.scaled_dot_product_attention.default": nn.masked_attention,
    "aten._scaled_dot_product_flash_attention_for_cpu.default": nn.attention,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": nn.attention,
    "aten.conv2d.default": nn.conv2d,
    "aten.conv1d.default": nn.conv2d,  # the same arguments, groups at 6
    "aten.rms_norm.default": r.leading_dims,
    "aten.convolution_backward.default": nn.conv2d_backward,
    **{k: nn.batch_passthrough for k in (
        "aten.max_pool2d_with_indices.default", "aten.max_pool2d_with_indices_backward.default",
        "aten.avg_pool2d.default", "aten.avg_pool2d_backward.default",
        "aten._adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d_backward.default")},
    DROPOUT: rnd.dropout_sbp,
    ROUTED_EXPERTS: moe.sbp,
    ROUTED_EXPERTS_BACKWARD: moe.sbp,
    RANDOM_LIKE: rnd.random_like_sbp,
    GRAD_SUM: nn.grad_sum,
    ACCUMULATE_GRAD: nn.accumulate,
    SGD: nn.optimizer,
    ADAMW: nn.optimizer,
    GRAD_SQ: nn.grad_sq,
    SQ_SUM: nn.sq_sum,
}


# Forward kinds with an SBP rule and no exact gradient, whose generic vjp
# takes the forward's own splits (ops/generic.py: vjp_sbp); pointwise ones too
SPLIT_VJP = frozenset({
    "aten.scaled_dot_product_attention.default", "aten.topk.default", "aten.stack.default",
    "aten.gather.default", "aten.sort.default", "aten.conv1d.default", "aten.rms_norm.default",
    "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.where.Scalar",
    "aten.log_sigmoid.default", "aten.multiply.Tensor", "aten.broadcast_tensors.default",
    "aten.mse_loss.default", "aten.tensor_split.indices", "aten.pad.default",
    "aten.constant_pad_nd.default", "aten.concatenate.default", "aten.scatter.value",
    "aten.repeat_interleave.self_int", "aten.baddbmm.default", "aten.einsum.default",
    "aten.cumsum.default", "aten.linalg_vector_norm.default", "aten.logsumexp.default",
    "aten.max.dim", "aten.var.correction", "aten.tril.default", "aten.triu.default",
    "aten.expand_as.default", "aten.view_as_complex.default", "aten.view_as_real.default"})
_POINTWISE = r.pointwise()


@cache
def tagged_pointwise(kind: str) -> bool:
    """Whether torch tags the aten op `kind` pointwise, and it draws nothing."""
    head, _, overload = kind.rpartition(".")
    packet = getattr(torch.ops.aten, head.removeprefix("aten."), None) \
        if head.startswith("aten.") else None
    op = getattr(packet, overload, None)
    tags = getattr(op, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def sbp_rule(kind: str) -> SbpRule:
    """The SBP rule of `kind` (the module docstring)."""
    return SBP.get(kind) or (_POINTWISE if tagged_pointwise(kind) else replicated_rule)


def splits_its_vjp(kind: str) -> bool:
    """Whether the generic vjp of a `kind` op takes the forward's splits."""
    return kind in SPLIT_VJP or tagged_pointwise(kind)


def replicated_rule(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """The default: every tensor replicated (correct for any op)."""
    return [replicated(len(tensors((args, kwargs))), len(outs))]
