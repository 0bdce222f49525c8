"""Rank-dependent kernel variants (`Job.variant`), bound at load time.

Each variant wraps the op's aten kernel for one rank, given the slices it
holds. Invariant: summed (Partial) or concatenated (Shard) over the ranks of
the axis, the variants' outputs equal the logical op's output.

  bias_first    row-parallel linear / conv: only the axis's first rank adds
                the bias, so the Partial sum counts it once
  vocab_offset  vocab-sharded embedding rows [lo, hi): look up ids in range
                (shifted by lo), zero the rest; its gradient keeps only the
                rows [lo, hi)
  class_offset  class-sharded log-probabilities [lo, hi) in nll_loss: pick
                only targets in range; the total weight counts every target
  mean_rescale  a mean over a sharded dim: local mean x local / global count
                (0 on a rank that holds none of it)
  replica_first a replicated gradient's squared norm (clipping): the axis's
                first rank counts it, the others give zero
  causal_offset causal attention (and its backward) of a rank's rows of the
                queries and keys: the causal mask at their positions (in
                order, or the load-balanced order), as an additive mask
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def bias_first(kernel, first: bool):
    if first:
        return kernel

    def no_bias(x, w, b=None, *rest, **kw):
        return kernel(x, w, None, *rest, **kw)

    return no_bias


def counted_elsewhere(param, grad, *rest, **kw):
    """grad_sq on a replica the axis's first rank counts: zero."""
    return grad.new_zeros((), dtype=torch.float32)


def _shift(idx: torch.Tensor, lo: int, hi: int, fill: int):
    outside = (idx < lo) | (idx >= hi)
    return (idx - lo).masked_fill(outside, fill), outside


def vocab_embedding(lo: int, hi: int):
    def embedding(w, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
        local, outside = _shift(idx, lo, hi, 0)
        pad = padding_idx - lo if lo <= padding_idx < hi else -1
        out = aten.embedding.default(w, local, pad, scale_grad_by_freq, sparse)
        return out.masked_fill(outside.unsqueeze(-1), 0)

    return embedding


def vocab_embedding_backward(lo: int, hi: int):
    def backward(g, idx, num_weights, padding_idx, scale_grad_by_freq):
        local, outside = _shift(idx, lo, hi, 0)
        g = g.masked_fill(outside.unsqueeze(-1), 0)
        pad = padding_idx - lo if lo <= padding_idx < hi else -1
        return aten.embedding_dense_backward.default(g, local, hi - lo, pad, scale_grad_by_freq)

    return backward


def class_nll(lo: int, hi: int):
    def nll(x, target, weight, reduction, ignore_index):
        local, outside = _shift(target, lo, hi, ignore_index)
        local = local.masked_fill(target == ignore_index, ignore_index)
        out, _ = aten.nll_loss_forward.default(x, local, weight, reduction, ignore_index)
        total = (target != ignore_index).sum().to(x.dtype)
        return out, total

    return nll


def class_nll_backward(lo: int, hi: int):
    def nll_backward(g, x, target, weight, reduction, ignore_index, total_weight):
        local, _ = _shift(target, lo, hi, ignore_index)
        local = local.masked_fill(target == ignore_index, ignore_index)
        return aten.nll_loss_backward.default(g, x, local, weight, reduction, ignore_index,
                                              total_weight)

    return nll_backward


def mean_rescale(kernel, local_shape, logical_shape, dims):
    """Scale a local mean over `dims` into this rank's share of the global mean."""
    nd = len(logical_shape)
    dims = range(nd) if dims in (None, ()) else [d % nd for d in (
        (dims,) if isinstance(dims, int) else dims)]
    ratio = math.prod(local_shape[d] for d in dims) / math.prod(logical_shape[d] for d in dims)

    def rescaled(*args, **kw):
        # a rank holding none of an uneven split (a dim of 2 over 4 ranks)
        # adds nothing: its local mean of no elements is nan, not 0
        out = kernel(*args, **kw)
        return out.zero_() if ratio == 0 else out * ratio

    return rescaled


def causal_mask(q_pos, k_pos, like: torch.Tensor) -> torch.Tensor:
    """-inf where a key's position comes after the query's (positions: sequences of ints)."""
    i = torch.tensor(list(q_pos), device=like.device)[:, None]
    j = torch.tensor(list(k_pos), device=like.device)[None, :]
    return torch.zeros(len(i), j.shape[1], dtype=like.dtype, device=like.device).masked_fill(
        j > i, float("-inf"))


def causal_attention(kernel, q_pos, k_pos):
    """The flash attention kernel, causal for queries and keys at these positions."""
    mask: list = []

    def attention(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        if not mask:
            mask.append(causal_mask(q_pos, k_pos, q))
        return kernel(q, k, v, dropout_p, False, attn_mask=mask[0], scale=scale)

    return attention


def causal_attention_backward(kernel, q_pos, k_pos):
    mask: list = []

    def backward(g, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                 scale=None):
        if not mask:
            mask.append(causal_mask(q_pos, k_pos, q))
        return kernel(g, q, k, v, out, lse, dropout_p, False, attn_mask=mask[0], scale=scale)

    return backward
