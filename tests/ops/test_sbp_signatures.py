"""Every SBP signature of every op rule (`ops/sbp_table.py` `SBP`), run.

For each case (an op kind with small random inputs) and each mesh-axis size
n in (2, 3), the rule's signatures are asked for as propagation asks, and each
one is executed: the inputs are cut per `sig.ins` (S(d): contiguous parts
along d, as `ir.sbp.split_range` cuts them; R: the whole tensor; P: random
addends summing to it), the op runs once per rank (shape arguments localized,
the rank-dependent variant `sig.variant` applied), and the per-rank outputs,
combined per `sig.outs` (S: concatenated, P: summed, P(max): maxed, R: each
rank equal), must equal the op applied to the whole inputs.

The variants are applied here from `runtime/local_kernels.py`, picking each
rank's slice from the signature itself: an independent reading of what
`runtime/bind.py` does with the plan's boxes.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from functools import partial
from typing import Callable

import pytest
import torch

from meshplan.ir import TensorMeta
from meshplan.ir.kinds import DROPOUT, RANDOM_LIKE, ROUTED_EXPERTS, ROUTED_EXPERTS_BACKWARD, VJP
from meshplan.ir.sbp import Partial, Shard, split_range
from meshplan.ops.counter_rng import RandomCounter
from meshplan.ops.random_ops import KERNELS as RANDOM_KERNELS
from meshplan.ops.sbp_sig import P, R, SbpSig
from meshplan.ops.sbp_table import SBP, tagged_pointwise
from meshplan.ops.table import rule_for
from meshplan.runtime import local_kernels as lk
from meshplan.runtime.expert_dispatch import routed_experts_backward_ep, routed_experts_ep
from meshplan.runtime.local import Hub, LocalComm
from meshplan.runtime.ring_attention import ring_attention, ring_attention_backward

F64, F32 = torch.float64, torch.float32
aten = torch.ops.aten


@dataclass(frozen=True)
class Case:
    """One op applied to small random float64 inputs (sizes divisible by 2 and 3)."""

    kind: str
    make: Callable[[], tuple]   # the op's arguments (tensors, literals)
    kw: tuple = ()              # its literal keyword arguments, as pairs
    tol: float = 1e-9


def f(*shape):
    return torch.randn(shape, dtype=F64)


def pos(*shape):
    return torch.rand(shape, dtype=F64) + 0.5


def ints(high, *shape):
    return torch.randint(0, high, shape)


def targets(classes, n):
    t = ints(classes, n)
    t[1] = -100  # an ignored sample
    return t


def mask(*shape):
    return torch.rand(shape) > 0.3


def _c(kind, make, tol=1e-9, **kw):
    return Case(kind, make, tuple(kw.items()), tol)


def _flash(b=6, h=6, L=4, e=4):
    q, k, v = f(b, h, L, e), f(b, h, L, e), f(b, h, L, e)
    return q, k, v


def _flash_backward():
    q, k, v = _flash(L=6)  # 6: a ring over 2 and 3 ranks
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)
    return (f(*out.shape), q, k, v, out, lse, 0.0, True)


ROUTED_KW = {"act": "aten.silu.default", "transposed": False}


def _routed(transposed: bool = False):
    """(x, choices, gates, w_in, w_out, an output gradient)."""
    w_in, w_out = (f(6, 6, 8), f(6, 4, 6)) if transposed else (f(6, 8, 6), f(6, 6, 4))
    return f(12, 6), ints(6, 12, 2), f(12, 2), w_in, w_out, f(12, 6)


_UNARY = ("exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu")
_LINEAR_BACKWARD = {
    "gelu_backward": lambda: (f(6, 6), f(6, 6)),
    "tanh_backward": lambda: (f(6, 6), f(6, 6)),
    "sigmoid_backward": lambda: (f(6, 6), f(6, 6)),
    "threshold_backward": lambda: (f(6, 6), f(6, 6), 0.0),
    "silu_backward": lambda: (f(6, 6), f(6, 6)),
    "native_dropout_backward": lambda: (f(6, 6), mask(6, 6), 2.0),
}
_RANDOM = {  # meshplan's random ops: each rank draws its box of the logical draw
    "dropout": _c(DROPOUT, lambda: (f(6, 6), 0.3, 5)),
    **{f"random_like_{d}": _c(RANDOM_LIKE, lambda d=d: (f(6, 6), d, 0.4, 3))
       for d in ("uniform", "normal", "bernoulli_p")},
    "random_like_bernoulli": _c(RANDOM_LIKE, lambda: (torch.rand(6, 6, dtype=F64),
                                                      "bernoulli", 0.0, 2)),
}
_POOL = {
    "max_pool2d_with_indices": lambda: (f(6, 6, 4, 4), (2, 2), (2, 2)),
    "avg_pool2d": lambda: (f(6, 6, 4, 4), (2, 2), (2, 2)),
    "_adaptive_avg_pool2d": lambda: (f(6, 6, 4, 4), (2, 2)),
    "avg_pool2d_backward": lambda: (f(6, 6, 2, 2), f(6, 6, 4, 4), (2, 2), (2, 2), (0, 0),
                                    False, True, None),
    "_adaptive_avg_pool2d_backward": lambda: (f(6, 6, 2, 2), f(6, 6, 4, 4)),
}


def _max_pool_backward():
    x = f(6, 6, 4, 4)
    out, idx = aten.max_pool2d_with_indices.default(x, (2, 2), (2, 2))
    return (f(*out.shape), x, (2, 2), (2, 2), (0, 0), (1, 1), False, idx)


SGD_KW = dict(lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.0, nesterov=False)
ADAMW_KW = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

CASES: dict[str, Case] = {
    "add": _c("aten.add.Tensor", lambda: (f(6, 6), f(6, 6))),
    "add_bcast": _c("aten.add.Tensor", lambda: (f(6, 6), f(6)), alpha=0.5),
    "add_bcast_both": _c("aten.add.Tensor", lambda: (f(6, 1), f(1, 6))),
    "add_number": _c("aten.add.Tensor", lambda: (f(6, 6), 2.5)),
    "sub": _c("aten.sub.Tensor", lambda: (f(6, 6), f(6, 6)), alpha=3),
    "sub_number": _c("aten.sub.Tensor", lambda: (f(6, 6), 1.5)),
    "rsub": _c("aten.rsub.Tensor", lambda: (f(6, 6), f(6, 6)), alpha=2),
    "rsub_scalar": _c("aten.rsub.Scalar", lambda: (f(6, 6), 2.0, 3)),
    "mul": _c("aten.mul.Tensor", lambda: (f(6, 6), f(6, 6))),
    "mul_bcast": _c("aten.mul.Tensor", lambda: (f(6, 1), f(6, 1, 6))),
    "mul_number": _c("aten.mul.Tensor", lambda: (f(6, 6), 2.0)),
    "div": _c("aten.div.Tensor", lambda: (f(6, 6), pos(6))),
    "div_number": _c("aten.div.Tensor", lambda: (f(6, 6), 4.0)),
    "neg": _c("aten.neg.default", lambda: (f(6, 6),)),
    "clone": _c("aten.clone.default", lambda: (f(6, 6),)),
    "contiguous": _c("aten.contiguous.default", lambda: (f(6, 6),)),
    "alias": _c("aten.alias.default", lambda: (f(6, 6),)),
    "to_copy": _c("aten._to_copy.default", lambda: (f(6, 6),), 1e-5, dtype=F32),
    "to_dtype": _c("aten.to.dtype", lambda: (f(6, 6), F32), 1e-5),
    **{k: _c(f"aten.{k}.default", make) for k, make in _LINEAR_BACKWARD.items()},
    **{k: _c(f"aten.{k}.default", lambda: (pos(6, 6),)) for k in _UNARY},
    "gelu_tanh": _c("aten.gelu.default", lambda: (f(6, 6),), approximate="tanh"),
    **_RANDOM,
    "pow": _c("aten.pow.Tensor_Scalar", lambda: (f(6, 6), 2.0)),
    "ne": _c("aten.ne.Scalar", lambda: (ints(3, 6, 6), 1)),
    **{k: _c(f"aten.{k}.Scalar", lambda: (f(6, 6), 0.1)) for k in ("eq", "lt", "le", "gt", "ge")},
    "clamp": _c("aten.clamp.default", lambda: (f(6, 6), -0.5, 0.5)),
    "clamp_min": _c("aten.clamp_min.default", lambda: (f(6, 6), 0.0)),
    "clamp_max": _c("aten.clamp_max.default", lambda: (f(6, 6), 0.0)),
    "abs": _c("aten.abs.default", lambda: (f(6, 6),)),
    "new_zeros": _c("aten.new_zeros.default", lambda: (f(6, 6), [3, 2])),
    "new_ones": _c("aten.new_ones.default", lambda: (f(6, 6), [3, 2])),
    "new_full": _c("aten.new_full.default", lambda: (f(6, 6), [3, 2], 1.5)),
    "one_hot": _c("aten.one_hot.default", lambda: (ints(4, 6, 6), 4)),
    "topk": _c("aten.topk.default", lambda: (f(6, 6), 2)),
    "topk_dim0": _c("aten.topk.default", lambda: (f(6, 6), 2, 0)),
    "cumsum": _c("aten.cumsum.default", lambda: (f(6, 6), 1)),
    "zeros_like": _c("aten.zeros_like.default", lambda: (f(6, 6),)),
    "ones_like": _c("aten.ones_like.default", lambda: (f(6, 6),)),
    "full_like": _c("aten.full_like.default", lambda: (f(6, 6), 3.0)),
    # views
    "view": _c("aten.view.default", lambda: (f(6, 4, 6), (6, 24))),
    "view_merge_lead": _c("aten.view.default", lambda: (f(6, 6, 4), (36, 4))),
    "reshape": _c("aten.reshape.default", lambda: (f(6, 4, 6), (24, 6))),
    "unsafe_view": _c("aten._unsafe_view.default", lambda: (f(6, 12), (6, 2, 6))),
    "unsqueeze": _c("aten.unsqueeze.default", lambda: (f(6, 6), 1)),
    "squeeze_dim": _c("aten.squeeze.dim", lambda: (f(6, 1, 6), 1)),
    "squeeze_dims": _c("aten.squeeze.dims", lambda: (f(6, 1, 6, 1), (1, 3))),
    "squeeze": _c("aten.squeeze.default", lambda: (f(6, 1, 6),)),
    "flatten": _c("aten.flatten.using_ints", lambda: (f(6, 4, 6), 1, 2)),
    "transpose": _c("aten.transpose.int", lambda: (f(6, 4, 6), 0, 2)),
    "t": _c("aten.t.default", lambda: (f(6, 12),)),
    "permute": _c("aten.permute.default", lambda: (f(6, 4, 6), (2, 0, 1))),
    "expand": _c("aten.expand.default", lambda: (f(6, 1, 6), (6, 12, 6))),
    "expand_lead": _c("aten.expand.default", lambda: (f(6, 1), (6, -1, 12))),
    # along one dim
    "split": _c("aten.split.Tensor", lambda: (f(6, 12), 4, 1)),
    "split_with_sizes": _c("aten.split_with_sizes.default", lambda: (f(6, 12), (5, 7), 1)),
    "chunk": _c("aten.chunk.default", lambda: (f(12, 6), 3, 0)),
    "unbind": _c("aten.unbind.int", lambda: (f(6, 3, 6), 1)),
    "cat": _c("aten.cat.default", lambda: ((f(6, 4), f(6, 2)), 1)),
    "stack": _c("aten.stack.default", lambda: ((f(6, 4), f(6, 4), f(6, 4)), 1)),
    "stack_last": _c("aten.stack.default", lambda: ((f(6, 6), f(6, 6)), -1)),
    "gather": _c("aten.gather.default", lambda: (f(6, 6, 4), 2, ints(4, 6, 6, 3))),
    "gather_fewer_rows": _c("aten.gather.default", lambda: (f(6, 6), 1, ints(6, 3, 2))),
    "sort": _c("aten.sort.default", lambda: (f(6, 6, 4),)),
    "sort_dim0": _c("aten.sort.default", lambda: (f(6, 6), 0, True)),
    "broadcast_tensors": _c("aten.broadcast_tensors.default",
                            lambda: ((f(6, 1), f(1, 6), f(6, 6)),)),
    "mse_loss_each": _c("aten.mse_loss.default", lambda: (f(6, 6), f(6, 6), 0)),
    "mse_loss_mean": _c("aten.mse_loss.default", lambda: (f(6, 6), f(6, 6))),
    "select_backward": _c("aten.select_backward.default",
                          lambda: (f(6, 4), (6, 3, 4), 1, 2)),
    "tensor_split": _c("aten.tensor_split.indices", lambda: (f(6, 6, 5), (2, 3), 2)),
    "pad": _c("aten.pad.default", lambda: (f(6, 6, 4), (0, 1), "constant", -100.0)),
    "pad_two_dims": _c("aten.pad.default", lambda: (f(6, 6, 4), (1, 1, 0, 0, 2, 0))),
    "constant_pad_nd": _c("aten.constant_pad_nd.default", lambda: (f(6, 6), (0, 0, 1, 2), 0.5)),
    "einsum": _c("aten.einsum.default",
                 lambda: ("bhld,bhmd->bhlm", (f(6, 2, 4, 3), f(6, 2, 6, 3)))),
    "einsum_three": _c("aten.einsum.default",
                       lambda: ("bc,cd,bd->b", (f(6, 4), f(4, 6), f(6, 6)))),
    "einsum_bcast": _c("aten.einsum.default", lambda: ("ij,kj->ik", (f(6, 1), f(4, 6)))),
    "einsum_diagonal": _c("aten.einsum.default", lambda: ("bii,bj->bij", (f(6, 4, 4), f(6, 6)))),
    "einsum_ellipsis": _c("aten.einsum.default", lambda: ("...d,d->...", (f(6, 4), f(4)))),
    "tril": _c("aten.tril.default", lambda: (f(6, 4, 4), 1)),
    "triu": _c("aten.triu.default", lambda: (f(6, 6, 4, 4),)),
    "expand_as": _c("aten.expand_as.default", lambda: (f(6, 1, 4), f(6, 6, 4))),
    "vector_norm": _c("aten.linalg_vector_norm.default", lambda: (f(6, 6, 4), 2, (-1,), True)),
    "vector_norm_all": _c("aten.linalg_vector_norm.default", lambda: (f(6, 4),)),
    "logsumexp": _c("aten.logsumexp.default", lambda: (f(6, 6, 4), (1,))),
    "max_dim": _c("aten.max.dim", lambda: (f(6, 6, 4), 2, True)),
    "var": _c("aten.var.correction", lambda: (f(6, 6, 4), (0, 2)), correction=1, keepdim=False),
    "view_as_complex": _c("aten.view_as_complex.default", lambda: (f(6, 4, 2),)),
    "view_as_real": _c("aten.view_as_real.default",
                       lambda: (torch.randn(6, 4, dtype=torch.complex128),)),
    "concatenate": _c("aten.concatenate.default", lambda: ((f(6, 4), f(6, 2)), 1)),
    "scatter_value": _c("aten.scatter.value", lambda: (f(6, 6, 4), 2, ints(4, 6, 6, 2), 1.0)),
    "repeat_interleave": _c("aten.repeat_interleave.self_int", lambda: (f(6, 6, 4), 2, 1)),
    "repeat_interleave_flat": _c("aten.repeat_interleave.self_int", lambda: (f(6, 4), 2)),
    "baddbmm": _c("aten.baddbmm.default", lambda: (f(6, 6, 4), f(6, 6, 3), f(6, 3, 4)),
                  beta=0.5, alpha=2.0),
    "baddbmm_bcast": _c("aten.baddbmm.default", lambda: (f(1, 6, 1), f(6, 6, 3), f(6, 3, 6))),
    "detach": _c("aten.detach.default", lambda: (f(6, 6),)),
    "multiply": _c("aten.multiply.Tensor", lambda: (f(6, 6), f(6))),
    "where_scalar_other": _c("aten.where.ScalarOther", lambda: (mask(6, 6), f(6, 6), 0.5)),
    "where_scalar_self": _c("aten.where.ScalarSelf", lambda: (mask(6, 1), 0.5, f(6, 6))),
    "where_scalar": _c("aten.where.Scalar", lambda: (mask(6, 6), 1.0, -1.0)),
    **{k: _c(f"aten.__{k}__.Tensor", lambda: (mask(6, 6), mask(6))) for k in ("and", "or", "xor")},
    "log_sigmoid": _c("aten.log_sigmoid.default", lambda: (f(6, 6),)),
    "cat_dim0": _c("aten.cat.default", lambda: ((f(6, 6, 6), f(6, 6, 6)),)),
    # a legacy empty piece (XLM's empty cache), Replicate while the others split
    "cat_empty": _c("aten.cat.default", lambda: ((torch.empty(0), f(6, 4, 6)), -2)),
    "slice": _c("aten.slice.Tensor", lambda: (f(6, 12), 1, 2, 10, 2)),
    "select": _c("aten.select.int", lambda: (f(6, 4, 6), 1, 2)),
    # the functional forms of writes into a tensor
    "slice_scatter": _c("aten.slice_scatter.default",
                        lambda: (f(6, 12), f(6, 4), 1, 2, 10, 2)),
    "select_scatter": _c("aten.select_scatter.default", lambda: (f(6, 4, 6), f(6, 6), 1, 2)),
    "select_scatter_last": _c("aten.select_scatter.default", lambda: (f(6, 4, 6), f(6, 4), -1, 0)),
    "copy": _c("aten.copy.default", lambda: (f(6, 6), f(6, 6))),
    "copy_bcast": _c("aten.copy.default", lambda: (f(6, 6), f(6))),
    "masked_fill": _c("aten.masked_fill.Scalar", lambda: (f(6, 6), f(6, 6) > 0, 0.5)),
    "masked_fill_bcast": _c("aten.masked_fill.Scalar", lambda: (f(6, 6), f(6) > 0, -1.0)),
    "masked_fill_tensor": _c("aten.masked_fill.Tensor",
                             lambda: (f(6, 6), f(6, 6) > 0, torch.tensor(2.0, dtype=F64))),
    "slice_backward": _c("aten.slice_backward.default",
                         lambda: (f(6, 4), (6, 12), 1, 2, 10, 2)),
    "softmax": _c("aten._softmax.default", lambda: (f(6, 4, 6), -1, False)),
    "log_softmax": _c("aten._log_softmax.default", lambda: (f(6, 4, 6), 1, False)),
    "softmax_backward": _c("aten._softmax_backward_data.default",
                           lambda: (f(6, 4, 6), f(6, 4, 6), 2, F64)),
    "log_softmax_backward": _c("aten._log_softmax_backward_data.default",
                               lambda: (f(6, 4, 6), f(6, 4, 6), 0, F64)),
    # reductions
    "sum": _c("aten.sum.default", lambda: (f(6, 4, 6),)),
    "sum_dim": _c("aten.sum.dim_IntList", lambda: (f(6, 4, 6), (1,))),
    "sum_dims_keep": _c("aten.sum.dim_IntList", lambda: (f(6, 4, 6), (0, 2), True)),
    "mean": _c("aten.mean.default", lambda: (f(6, 4, 6),)),
    "mean_dim": _c("aten.mean.dim", lambda: (f(6, 4, 6), (-1,), True)),
    "mean_dims": _c("aten.mean.dim", lambda: (f(6, 4, 6), (0, 2))),
    "amax": _c("aten.amax.default", lambda: (f(6, 4, 6), (1,))),
    "amax_all": _c("aten.amax.default", lambda: (f(6, 4, 6), (), True)),
    # neural-network ops
    "linear": _c("aten.linear.default", lambda: (f(6, 4, 6), f(12, 6), f(12))),
    "linear_no_bias": _c("aten.linear.default", lambda: (f(6, 6), f(12, 6))),
    "mm": _c("aten.mm.default", lambda: (f(6, 12), f(12, 6))),
    "bmm": _c("aten.bmm.default", lambda: (f(6, 6, 12), f(6, 12, 6))),
    "matmul_bcast": _c("aten.matmul.default", lambda: (f(6, 6, 12), f(12, 6))),
    "matmul_bcast_left": _c("aten.matmul.default", lambda: (f(6, 12), f(6, 12, 6))),
    "matmul_vector": _c("aten.matmul.default", lambda: (f(6, 12), f(12))),
    "addmm": _c("aten.addmm.default", lambda: (f(6), f(6, 12), f(12, 6))),
    "layer_norm": _c("aten.native_layer_norm.default",
                     lambda: (f(6, 4, 6), (6,), pos(6), f(6), 1e-5)),
    "layer_norm_backward": _c("aten.native_layer_norm_backward.default", lambda: (
        f(6, 4, 6), f(6, 4, 6), (6,), f(6, 4, 1), pos(6, 4, 1), pos(6), f(6),
        (True, True, True))),
    "embedding": _c("aten.embedding.default", lambda: (f(12, 6), ints(12, 6, 4))),
    "embedding_padding": _c("aten.embedding.default", lambda: (f(12, 6), ints(12, 6), 3)),
    "embedding_backward": _c("aten.embedding_dense_backward.default",
                             lambda: (f(6, 4, 6), ints(12, 6, 4), 12, -1, False)),
    "nll_loss": _c("aten.nll_loss_forward.default",
                   lambda: (f(6, 12), targets(12, 6), None, 2, -100)),
    "nll_loss_weight": _c("aten.nll_loss_forward.default",
                          lambda: (f(6, 12), targets(12, 6), pos(12), 2, -100)),
    "nll_loss_mean": _c("aten.nll_loss_forward.default",
                        lambda: (f(6, 12), targets(12, 6), None, 1, -100)),
    "nll_loss_backward": _c("aten.nll_loss_backward.default", lambda: (
        f(), f(6, 12), targets(12, 6), None, 2, -100, torch.tensor(5.0, dtype=F64))),
    "nll_loss_backward_weight": _c("aten.nll_loss_backward.default", lambda: (
        f(), f(6, 12), targets(12, 6), pos(12), 2, -100, torch.tensor(5.0, dtype=F64))),
    "flash": _c("aten._scaled_dot_product_flash_attention_for_cpu.default",
                lambda: (*_flash(L=6), 0.0, True)),
    "flash_bidirectional": _c("aten._scaled_dot_product_flash_attention_for_cpu.default",
                              lambda: (*_flash(L=6), 0.0, False)),
    "index_select": _c("aten.index_select.default", lambda: (f(6, 12, 4), 1, ints(12, 6))),
    "flash_backward": _c("aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
                         _flash_backward),
    # masked attention: a float mask of every dim, one broadcast over the batch
    # (T5's position bias), one over the heads (BART's padding mask), a bool one
    "sdpa_mask_full": _c("aten.scaled_dot_product_attention.default",
                         lambda: (*_flash(), f(6, 6, 4, 4))),
    "sdpa_mask_heads": _c("aten.scaled_dot_product_attention.default",
                          lambda: (*_flash(), f(1, 6, 4, 4))),
    "sdpa_mask_batch": _c("aten.scaled_dot_product_attention.default",
                          lambda: (*_flash(), f(6, 1, 4, 4))),
    "sdpa_mask_2d_bool": _c("aten.scaled_dot_product_attention.default",
                            lambda: (*_flash(), torch.ones(4, 4, dtype=torch.bool).tril())),
    "conv2d": _c("aten.conv2d.default",
                 lambda: (f(6, 6, 5, 5), f(12, 6, 3, 3), f(12), (1, 1), (1, 1), (1, 1), 1)),
    "conv2d_groups": _c("aten.conv2d.default",
                        lambda: (f(6, 6, 5, 5), f(12, 3, 3, 3), f(12), (1, 1), (0, 0), (1, 1), 2)),
    "conv2d_backward": _c("aten.convolution_backward.default", lambda: (
        f(6, 12, 5, 5), f(6, 6, 5, 5), f(12, 6, 3, 3), (12,), (1, 1), (1, 1), (1, 1), False,
        (0, 0), 1, (True, True, True))),
    "conv1d": _c("aten.conv1d.default",
                 lambda: (f(6, 6, 5), f(12, 6, 3), f(12), (1,), (1,), (1,), 1)),
    "conv1d_depthwise": _c("aten.conv1d.default",
                           lambda: (f(6, 6, 5), f(6, 1, 3), f(6), (1,), (2,), (1,), 6)),
    "rms_norm": _c("aten.rms_norm.default", lambda: (f(6, 6, 4), (4,), f(4), 1e-6)),
    "rms_norm_2d": _c("aten.rms_norm.default", lambda: (f(6, 6, 4), (6, 4), None, None)),
    **{k: _c(f"aten.{k}.default", make) for k, make in _POOL.items()},
    "max_pool2d_with_indices_backward": _c("aten.max_pool2d_with_indices_backward.default",
                                           _max_pool_backward),
    # meshplan's own ops
    "grad_sum": _c("meshplan.grad_sum", lambda: (f(6, 6), f(6, 6), f(6, 6))),
    "accumulate_grad": _c("meshplan.accumulate_grad", lambda: (f(6, 6), f(6, 6))),
    "sgd": _c("meshplan.sgd", lambda: (f(6, 12), f(6, 12), f(6, 12)), **SGD_KW),
    "adamw": _c("meshplan.adamw", lambda: (
        f(6, 12), f(6, 12), f(6, 12), pos(6, 12), torch.tensor(3.0, dtype=F64)), **ADAMW_KW),
    # clipping: a gradient's squared norm in the optimizer's layout, Partial out
    "grad_sq": _c("meshplan.grad_sq", lambda: (f(6, 12), f(6, 12), f(6, 12)), tol=1e-12),
    "sq_sum": _c("meshplan.sq_sum", lambda: (pos(), pos(), pos())),
    # routed experts: 12 tokens of 6 choosing 2 of 6 experts (in 8 = gate, up; out 4)
    "routed_experts": _c(ROUTED_EXPERTS, lambda: _routed()[:5], **ROUTED_KW),
    "routed_experts_transposed": _c(ROUTED_EXPERTS, lambda: _routed(True)[:5],
                                    act="aten.gelu.default", transposed=True),
    "routed_experts_backward": _c(ROUTED_EXPERTS_BACKWARD, _routed, **ROUTED_KW),
}


def _walk(a, fn):
    """`a` with each tensor `t` replaced by `fn(t)`, in the traversal order
    of `sbp_sig.tensors` (depth first, left to right)."""
    if isinstance(a, torch.Tensor):
        return fn(a)
    if isinstance(a, (tuple, list)):
        return tuple(_walk(x, fn) for x in a)
    return a


def _tensors(args) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _walk(args, lambda t: found.append(t) or t)
    return found


def _with(args, tensors: list[torch.Tensor]):
    """`args` with its tensors replaced, in order, by `tensors`."""
    it = iter(tensors)
    return _walk(args, lambda _t: next(it))


def _outputs(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _part(shape, s, n: int, i: int) -> tuple[slice, ...]:
    """Rank i's index into a tensor of `shape` laid out as `s` (the whole if not S)."""
    index = [slice(None)] * len(shape)
    if isinstance(s, Shard):
        index[s.dim] = slice(*split_range(shape[s.dim], n, i))
    return tuple(index)


def _pieces(t: torch.Tensor, s, n: int) -> list[torch.Tensor]:
    """The n local tensors of `t` laid out as `s` (own copies: optimizers write)."""
    if isinstance(s, Partial):
        assert s.op == "sum", f"no input is {s}"
        addends = [torch.randn_like(t) if t.is_floating_point()
                   else torch.randint_like(t, -5, 5) for _ in range(n - 1)]
        return addends + [t - sum(addends)]
    return [t[_part(t.shape, s, n, i)].clone() for i in range(n)]


def _variant(kind, sig: SbpSig, args, whole, n: int, i: int):
    """The rank's kernel: the rule's, wrapped per `sig.variant`; a random
    op's drawing rank i's box of its output (as `runtime/bind.py` binds it)."""
    kernel = rule_for(kind).kernel
    ts = _tensors(args)
    if kind in RANDOM_KERNELS:
        shape = tuple(whole[0].shape)
        part = _part(shape, sig.outs[0], n, i)
        box = tuple(sl.indices(size)[:2] for sl, size in zip(part, shape))
        return partial(kernel, draw={"box": box, "shape": shape,
                                     "stream": RandomCounter().stream(args[-1], shape)})
    if sig.variant == "bias_first":
        return lk.bias_first(kernel, i == 0)
    if sig.variant == "replica_first":
        return kernel if i == 0 else lk.counted_elsewhere
    if sig.variant == "vocab_offset" and kind == "aten.embedding.default":
        return lk.vocab_embedding(*split_range(ts[0].shape[0], n, i))
    if sig.variant == "vocab_offset":
        return lk.vocab_embedding_backward(*split_range(whole[0].shape[0], n, i))
    if sig.variant == "class_offset" and kind == "aten.nll_loss_forward.default":
        return lk.class_nll(*split_range(ts[0].shape[1], n, i))
    if sig.variant == "class_offset":
        return lk.class_nll_backward(*split_range(ts[1].shape[1], n, i))
    if sig.variant == "mean_rescale":
        x = ts[0]
        local = x[_part(x.shape, sig.ins[0], n, i)].shape
        return lk.mean_rescale(kernel, tuple(local), tuple(x.shape), args[1] if len(args) > 1
                               else None)
    if sig.variant == "causal_offset":  # a rank's rows of the queries, every key
        q = ts[1] if len(ts) == 6 else ts[0]
        rows = range(*split_range(q.shape[2], n, i))
        wrap = lk.causal_attention_backward if len(ts) == 6 else lk.causal_attention
        return wrap(kernel, rows, range(q.shape[2]))
    assert not sig.variant, f"unknown kernel variant {sig.variant!r} of {kind}"
    return kernel


def _ring(case: Case, args, n: int, i: int, comm, group) -> Callable:
    """Rank i's ring kernel: given its rows and every member's keys as runs
    of tokens (in order here)."""
    ts = _tensors(args)
    backward = len(ts) == 6
    wrap = ring_attention_backward if backward else ring_attention
    seq = ts[1 if backward else 0].shape[2]
    keys = [((0, lo, hi - lo),) for lo, hi in (split_range(seq, n, j) for j in range(n))]
    return wrap(rule_for(case.kind).kernel, keys[i], keys, i,
                lambda x, step: comm.shift(x, group, 0, step))


def _routed_kernel(case: Case, args, n: int, i: int, comm, group) -> Callable:
    """Rank i's routed experts kernel, its rows sent through the hub."""
    make = routed_experts_backward_ep if case.kind == ROUTED_EXPERTS_BACKWARD else \
        routed_experts_ep
    return make(lambda flat, sizes, counts: comm.all_to_all(flat, sizes, counts, group), n)


_INSIDE = {"ring": _ring, "experts": _routed_kernel}  # variants whose kernels communicate


def _inside_ranks(case: Case, sig: SbpSig, args, n: int, pieces) -> list[tuple]:
    """Every rank's outputs under a signature whose kernel communicates
    (RING, EXPERTS): the n ranks at once, on threads exchanging through a
    local hub."""
    hub, group, out = Hub(30.0), tuple(range(n)), [None] * n

    def rank(i: int) -> None:
        comm = LocalComm(i, [group], hub, n)
        kernel = _INSIDE[sig.variant](case, args, n, i, comm, group)
        out[i] = _outputs(kernel(*_with(args, [p[i] for p in pieces]), **dict(case.kw)))

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(o is not None for o in out), f"a {sig.variant} rank failed or hung"
    return out  # type: ignore[return-value]


def _localize(kind, args, whole, sig: SbpSig, n: int, i: int) -> tuple:
    """`args` with the rule's shape arguments set to rank i's output shapes."""
    args = list(args)
    for pos_, out in rule_for(kind).shape_args:
        shape = whole[out].shape
        args[pos_] = tuple(whole[out][_part(shape, sig.outs[out], n, i)].shape)
    return tuple(args)


def _combine(parts, s):
    if isinstance(s, Shard):
        return torch.cat(parts, s.dim)
    if isinstance(s, Partial) and s.op == "max":
        return torch.stack(parts).amax(0)
    if isinstance(s, Partial):
        return sum(parts[1:], parts[0])
    for p in parts[1:]:
        torch.testing.assert_close(p, parts[0], rtol=0, atol=0, msg="R output differs by rank")
    return parts[0]


def check_signature(case: Case, args, whole, sig: SbpSig, n: int) -> None:
    """Run `case`'s op per rank under `sig`; the combined outputs must be `whole`."""
    ts = _tensors(args)
    assert len(sig.ins) == len(ts) and len(sig.outs) == len(whole), sig
    pieces = [_pieces(t, s, n) for t, s in zip(ts, sig.ins)]
    kw = dict(case.kw)
    if sig.variant in _INSIDE:  # every rank at once: they pass blocks or rows to each other
        per_rank = _inside_ranks(case, sig, args, n, pieces)
    else:
        per_rank = [_outputs(_variant(case.kind, sig, args, whole, n, i)(
            *_localize(case.kind, _with(args, [p[i] for p in pieces]), whole, sig, n, i), **kw))
            for i in range(n)]
    for k, (want, s) in enumerate(zip(whole, sig.outs)):
        where = f"{case.kind} {_fmt(sig)} n={n} output {k}"
        if want is None:
            assert s is None, f"{where}: absent but laid out as {s}"
            continue
        got = _combine([r[k] for r in per_rank], s)
        torch.testing.assert_close(got, want, rtol=case.tol, atol=case.tol,
                                   msg=lambda m, where=where: f"{where}: {m}")


def _fmt(sig: SbpSig) -> str:
    ins = ", ".join(str(s) for s in sig.ins)
    outs = ", ".join(str(s) for s in sig.outs)
    return f"({ins}) -> ({outs})" + (f" [{sig.variant}]" if sig.variant else "")


def _signatures(case: Case, n: int):
    """(args, whole outputs, the rule's signatures) as propagation asks for them."""
    torch.manual_seed(zlib.crc32(case.kind.encode()))
    args = case.make()
    whole = _outputs(rule_for(case.kind).kernel(*_walk(args, torch.clone), **dict(case.kw)))
    outs = tuple(None if o is None else TensorMeta.of(o) for o in whole)
    sigs = rule_for(case.kind).sbp(_walk(args, TensorMeta.of), dict(case.kw), outs, n)
    return args, whole, sigs


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_every_signature_gives_the_logical_result(name, n):
    case = CASES[name]
    args, whole, sigs = _signatures(case, n)
    replicated = SbpSig((R,) * len(sigs[-1].ins),
                        tuple(None if o is None else R for o in whole))
    assert replicated in sigs, f"{case.kind}: no all-Replicate signature"
    for sig in sigs:
        check_signature(case, args, whole, sig, n)


# Aten ops torch tags pointwise, listed in no table: the pointwise rule
TAGGED = {
    "sin": _c("aten.sin.default", lambda: (f(6, 6),)),
    "erf": _c("aten.erf.default", lambda: (f(6, 6),)),
    "softplus": _c("aten.softplus.default", lambda: (f(6, 6), 1.5, 20.0)),
    "square": _c("aten.square.default", lambda: (f(6, 6),)),
    "expm1": _c("aten.expm1.default", lambda: (f(6, 6),)),
    "bitwise_not": _c("aten.bitwise_not.default", lambda: (mask(6, 6),)),
    "eq": _c("aten.eq.Tensor", lambda: (ints(3, 6, 6), ints(3, 6))),
    "where": _c("aten.where.self", lambda: (mask(6, 1), f(6, 6), f(6))),
    "pow": _c("aten.pow.Tensor_Tensor", lambda: (pos(6, 6), f(1, 6))),
    "minimum": _c("aten.minimum.default", lambda: (f(6, 6), f(6, 6))),
    "lerp": _c("aten.lerp.Tensor", lambda: (f(6, 6), f(6, 6), pos(6))),
}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(TAGGED))
def test_an_op_torch_tags_pointwise_splits_as_one(name, n):
    """Not in the table, yet split: torch's `pointwise` tag gives the rule,
    each of whose signatures computes the logical result; a random op with
    the tag (rrelu) stays whole."""
    case = TAGGED[name]
    assert case.kind not in SBP and tagged_pointwise(case.kind)
    args, whole, sigs = _signatures(case, n)
    assert any(isinstance(s, Shard) for sig in sigs for s in sig.outs), sigs
    for sig in sigs:
        check_signature(case, args, whole, sig, n)
    assert not tagged_pointwise("aten.rrelu.default") and \
        rule_for("aten.rrelu.default").sbp(_walk((f(6, 6),), TensorMeta.of), {},
                                           (TensorMeta.of(f(6, 6)),), n) == [SbpSig((R,), (R,))]


# The generic vjp of a forward kind `splits_its_vjp`: its signatures from the forward's
VJPS = {"erf": (TAGGED["erf"], (0,)), "pow": (TAGGED["pow"], (0, 1)),
        "gather": (CASES["gather"], (0,)), "stack": (CASES["stack"], (0, 1, 2)),
        "rms_norm": (CASES["rms_norm"], (0, 1)), "conv1d": (CASES["conv1d"], (0, 1, 2)),
        "mse_loss": (CASES["mse_loss_each"], (0, 1)),
        "broadcast_tensors": (CASES["broadcast_tensors"], (0, 1, 2)),
        "tensor_split": (CASES["tensor_split"], (0,)), "pad": (CASES["pad"], (0,)),
        "baddbmm": (CASES["baddbmm_bcast"], (0, 1, 2)),
        "repeat_interleave": (CASES["repeat_interleave"], (0,)),
        "scatter_value": (CASES["scatter_value"], (0,)),
        "einsum": (CASES["einsum_three"], (0, 1, 2)), "cumsum": (CASES["cumsum"], (0,)),
        "vector_norm": (CASES["vector_norm"], (0,)), "tril": (CASES["tril"], (0,)),
        "expand_as": (CASES["expand_as"], (0,)), "logsumexp": (CASES["logsumexp"], (0,)),
        "view_as_complex": (CASES["view_as_complex"], (0,))}


def _vjp_case(name: str) -> Case:
    fwd, wrt = VJPS[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    args = fwd.make()
    out = _outputs(rule_for(fwd.kind).kernel(*_walk(args, torch.clone), **dict(fwd.kw)))
    gouts = tuple(torch.randn(o.shape, dtype=o.dtype) for o in out)
    return _c(VJP, lambda: (fwd.kind, args, tuple(fwd.kw), gouts, wrt), tol=1e-9)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(VJPS))
def test_a_generic_vjp_splits_as_its_forward(name, n):
    """Each of its signatures gives the logical gradients: a split input's
    shard, a broadcast one's Partial share."""
    case = _vjp_case(name)
    args, whole, sigs = _signatures(case, n)
    assert len(sigs) > 1, sigs
    for sig in sigs:
        check_signature(case, args, whole, sig, n)


def test_every_rule_has_a_case():
    covered = {c.kind for c in CASES.values()}
    # new_empty's values are whatever memory held: its rule is new_zeros' (meta_only)
    assert SBP["aten.new_empty.default"] is SBP["aten.new_zeros.default"]
    assert set(SBP) - {"aten.new_empty.default"} <= covered, sorted(set(SBP) - covered)


def test_a_wrong_signature_is_caught():
    """The check itself: exp is not linear, and a batch shard is not a class shard."""
    exp = CASES["exp"]
    args, whole, _ = _signatures(exp, 2)
    with pytest.raises(AssertionError, match=r"aten.exp.default \(P\) -> \(P\) n=2"):
        check_signature(exp, args, whole, SbpSig((P,), (P,)), 2)
    mm = CASES["mm"]
    args, whole, _ = _signatures(mm, 2)
    with pytest.raises(AssertionError, match="aten.mm.default"):
        check_signature(mm, args, whole, SbpSig((Shard(0), R), (Shard(1),)), 2)
