"""SBP rules of pointwise, layout, view and reduction ops (one mesh axis).

See `sbp_sig.py` for the contract. Shards of views need the sharded size to
divide by the axis size, so the split lines up before and after the view.
"""

from __future__ import annotations

from typing import Callable

from meshplan.ir import TensorMeta
from meshplan.ir.choices import KernelVariant
from meshplan.ir.sbp import Partial, Sbp, Shard
from meshplan.ops.sbp_sig import (
    Outs,
    P,
    R,
    SbpRule,
    SbpSig,
    divisible,
    norm_dim,
    out_meta,
    replicated,
    tensors,
)

PMAX = Partial("max")


def _out_shape(ts: list[TensorMeta]) -> tuple[int, ...]:
    nd = max(len(t.shape) for t in ts)
    shape = [1] * nd
    for t in ts:
        for i, s in enumerate(t.shape):
            j = nd - len(t.shape) + i
            shape[j] = max(shape[j], s)
    return tuple(shape)


def _broadcast_shards(ts: list[TensorMeta], n_out: int) -> list[SbpSig]:
    """S(d) on the outputs <- S(d') on inputs that have dim d, R where broadcast."""
    out = _out_shape(ts)
    sigs = []
    for d, size in enumerate(out):
        if size < 2:
            continue
        ins = []
        for t in ts:
            j = d - (len(out) - len(t.shape))
            ins.append(Shard(j) if j >= 0 and t.shape[j] == size else R)
        sigs.append(SbpSig(tuple(ins), (Shard(d),) * n_out))
    return sigs


def pointwise(linear_in: tuple[int, ...] = ()) -> SbpRule:
    """Elementwise ops. `linear_in`: input positions the op is linear in alone
    (a Partial there, Replicate elsewhere, gives a Partial output)."""

    def rule(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
        ts = tensors((args, kwargs))
        sigs = _broadcast_shards(ts, len(outs))
        for i in linear_in:
            if i < len(ts):
                sigs.append(SbpSig(tuple(P if j == i else R for j in range(len(ts))), (P,)))
        return sigs + [replicated(len(ts), len(outs))]

    return rule


def broadcast(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """broadcast_tensors: each output its input expanded to the common shape."""
    ts = tensors((args, kwargs))
    return _broadcast_shards(ts, len(outs)) + [replicated(len(ts), len(outs))]


def elementwise_loss(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """mse_loss(x, y, reduction): pointwise when it reduces nothing (0), the
    form capture emits (`canonical.elementwise_loss`); whole otherwise."""
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    return pointwise()(args, kwargs, outs, n) if reduction == 0 else [replicated(2, 1)]


def additive(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """add / sub / rsub: Partial + Partial is Partial. Not with a number
    operand: each rank would add it, so the sum would hold it n times."""
    ts = tensors((args, kwargs))
    sigs = _broadcast_shards(ts, 1)
    if len(ts) == 2 and all(t.shape == ts[0].shape for t in ts):
        sigs.append(SbpSig((P,) * len(ts), (P,)))
    return sigs + [replicated(len(ts), 1)]


def like(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """zeros_like / ones_like / full_like: the output follows the input's layout."""
    (t,) = tensors((args, kwargs))
    sigs = [SbpSig((Shard(d),), (Shard(d),)) for d in range(len(t.shape)) if t.shape[d] > 1]
    return sigs + [SbpSig((P,), (R,)), replicated(1, 1)]


def keeps_dims(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """An op whose output keeps its input's dims in front (one_hot adds a
    trailing one): a split input dim stays split; nothing linear."""
    (t,) = tensors((args, kwargs))
    sigs = [SbpSig((Shard(d),), (Shard(d),) * len(outs))
            for d in range(len(t.shape)) if t.shape[d] > 1]
    return sigs + [replicated(1, len(outs))]


def meta_only(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """new_zeros and its kin read only their input's dtype and device: any
    layout of it will do, and the output is whole everywhere."""
    (t,) = tensors((args, kwargs))
    ins = [Shard(d) for d in range(len(t.shape)) if t.shape[d] > 1] + [P]
    return [SbpSig((s,), (R,) * len(outs)) for s in ins] + [replicated(1, len(outs))]


def _groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims of `a` and `b` with equal products (a view's dim map)."""
    i = j = 0
    out = []
    while i < len(a) or j < len(b):
        gi, gj = [i] if i < len(a) else [], [j] if j < len(b) else []
        pa = a[i] if i < len(a) else 1
        pb = b[j] if j < len(b) else 1
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(i)
                pa *= a[i]
                i += 1
            else:
                gj.append(j)
                pb *= b[j]
                j += 1
        out.append((gi, gj))
    return out


def view(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """view / reshape / flatten / squeeze / unsqueeze: track the split dim."""
    (t,) = tensors(args[:1])
    out_shape = out_meta(outs).shape
    a = [(d, s) for d, s in enumerate(t.shape) if s != 1]
    b = [(d, s) for d, s in enumerate(out_shape) if s != 1]
    sigs = []
    for gi, gj in _groups(tuple(s for _, s in a), tuple(s for _, s in b)):
        if not gi or not gj:
            continue
        din, size_in = a[gi[0]]
        dout, size_out = b[gj[0]]
        if divisible(size_in, n) and divisible(size_out, n):
            sigs.append(SbpSig((Shard(din),), (Shard(dout),)))
    return sigs + [SbpSig((P,), (P,)), replicated(1, 1)]


def permuting(perm_of: Callable[[tuple, int], list[int]]) -> SbpRule:
    """transpose / t / permute: S(d) -> S(perm(d))."""

    def rule(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
        (t,) = tensors(args[:1])
        perm = perm_of(args, len(t.shape))
        sigs = [SbpSig((Shard(perm[j]),), (Shard(j),)) for j in range(len(perm))
                if t.shape[perm[j]] > 1]
        return sigs + [SbpSig((P,), (P,)), replicated(1, 1)]

    return rule


def _transpose_perm(args: tuple, nd: int) -> list[int]:
    a, b = norm_dim(args[1], nd), norm_dim(args[2], nd)
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return perm


transpose = permuting(_transpose_perm)
t = permuting(lambda args, nd: list(reversed(range(nd))))
permute = permuting(lambda args, nd: [norm_dim(d, nd) for d in args[1]])


def expand(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    (t,) = tensors(args[:1])
    # the output's shape, not the literal sizes: on a later mesh axis both
    # are one shard's, where an earlier axis split a dim the literal names whole
    size = out_meta(outs).shape if outs and outs[0] is not None else args[1]
    lead = len(size) - len(t.shape)
    sigs = [SbpSig((Shard(d),), (Shard(d + lead),)) for d in range(len(t.shape))
            if t.shape[d] > 1 and size[d + lead] in (-1, t.shape[d])]
    return sigs + [SbpSig((P,), (P,)), replicated(1, 1)]


def along_dim(dim_index: int, removes_dim: bool = False, default_dim: int = 0,
              linear: bool = True) -> SbpRule:
    """Ops acting along one dim (split, cat, slice, select, softmax...): any
    other dim may be sharded; the output keeps it. `linear` ops also pass
    Partial through."""

    def rule(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
        ts = tensors((args, kwargs))
        outs_count = len(outs)
        nd = len(ts[0].shape)
        dim = args[dim_index] if dim_index < len(args) else kwargs.get("dim", default_dim)
        dim = norm_dim(dim, nd)
        sigs = []
        for d in range(nd):
            if d == dim or ts[0].shape[d] < 2:
                continue
            od = d - 1 if removes_dim and d > dim else d
            sigs.append(SbpSig((Shard(d),) * len(ts), (Shard(od),) * outs_count))
        if linear:
            sigs.append(SbpSig((P,) * len(ts), (P,) * outs_count))
        return sigs + [replicated(len(ts), outs_count)]

    return rule


_CAT = along_dim(1)


def cat(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """cat's signatures (`along_dim`) over the pieces that take part; a
    legacy empty piece (shape (0,), which torch.cat skips: XLM's empty
    key/value cache) is the same on every rank, so Replicate in each, and
    cannot make the others whole."""
    pieces = args[0]
    empty = [isinstance(t, TensorMeta) and t.shape == (0,) for t in pieces]
    if not any(empty) or all(empty):
        return _CAT(args, kwargs, outs, n)
    kept = tuple(t for t, e in zip(pieces, empty) if not e)
    sigs = []
    for sig in _CAT((kept, *args[1:]), kwargs, outs, n):
        ins = iter(sig.ins)
        sigs.append(SbpSig(tuple(R if e else next(ins) for e in empty), sig.outs))
    return sigs


def select_scatter(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """select_scatter(x, src, dim, index): src is x without `dim`; any other
    dim may be sharded on both; linear in (x, src) together."""
    x, _src = tensors(args[:2])
    nd = len(x.shape)
    dim = norm_dim(args[2], nd)
    sigs = [SbpSig((Shard(d), Shard(d - (d > dim))), (Shard(d),))
            for d in range(nd) if d != dim and x.shape[d] >= 2]
    return sigs + [SbpSig((P, P), (P,)), replicated(2, 1)]


def reduction(kind: str) -> SbpRule:
    """sum / mean / amax over `dim` (None: all): a sharded reduced dim gives a
    Partial ("mean" rescales locally, "max" reduces by max)."""

    def rule(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
        (x,) = tensors(args[:1])
        nd = len(x.shape)
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = tuple(range(nd)) if dims in (None, ()) else (
            (dims,) if isinstance(dims, int) else tuple(dims))
        dims = {norm_dim(d, nd) for d in dims}
        keep = bool(args[2]) if len(args) > 2 else bool(kwargs.get("keepdim", False))
        sigs = []
        for d in range(nd):
            if x.shape[d] < 2:
                continue
            if d in dims:
                out = PMAX if kind == "max" else P
                rescale = KernelVariant.MEAN_RESCALE if kind == "mean" else KernelVariant.NONE
                sigs.append(SbpSig((Shard(d),), (out,), rescale))
            else:
                od = d if keep else d - sum(1 for r in dims if r < d)
                sigs.append(SbpSig((Shard(d),), (Shard(od),)))
        if kind != "max":
            sigs.append(SbpSig((P,), (P,)))
        return sigs + [replicated(1, 1)]

    return rule


def stack(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """stack(tensors, dim): equal shapes; input dim d is the output's d, or
    d + 1 from the new dim on. Linear in all of them together."""
    ts = tensors(args[:1])
    nd = len(ts[0].shape)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    dim = dim + nd + 1 if dim < 0 else dim
    sigs = [SbpSig((Shard(d),) * len(ts), (Shard(d + (d >= dim)),))
            for d in range(nd) if ts[0].shape[d] > 1]
    return sigs + [SbpSig((P,) * len(ts), (P,)), replicated(len(ts), 1)]


def gather(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """gather(x, dim, index): the output has the index's shape. A dim other
    than `dim` may be split on both where they are equal; the index's `dim`
    may be split against the whole input (each rank picks its entries: the
    index's other dims must meet the input's rows they name, so not those)."""
    x, index = tensors((args, kwargs))
    nd = len(x.shape)
    dim = norm_dim(args[1], nd)
    sigs = [SbpSig((Shard(d), Shard(d)), (Shard(d),)) for d in range(nd)
            if d != dim and index.shape[d] > 1 and x.shape[d] == index.shape[d]]
    if index.shape[dim] > 1:
        sigs.append(SbpSig((R, Shard(dim)), (Shard(dim),)))
    return sigs + [replicated(2, 1)]


def leading_dims(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """rms_norm(x, normalized_shape, weight?, eps): the dims before the
    normalized ones may be split (the weight whole)."""
    ts = tensors((args, kwargs))
    x = ts[0]
    lead = len(x.shape) - len(args[1])
    w = (R,) * (len(ts) - 1)
    sigs = [SbpSig((Shard(d),) + w, (Shard(d),) * len(outs))
            for d in range(lead) if x.shape[d] > 1]
    return sigs + [replicated(len(ts), len(outs))]


def select_backward(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """select_backward(g, sizes, dim, index): g is the output without `dim`;
    any other dim may be split on both. Linear in g."""
    nd = len(out_meta(outs).shape)
    dim = norm_dim(args[2], nd)
    sigs = [SbpSig((Shard(d - (d > dim)),), (Shard(d),)) for d in range(nd)
            if d != dim and out_meta(outs).shape[d] > 1]
    return sigs + [SbpSig((P,), (P,)), replicated(1, 1)]


def padded(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """pad / constant_pad_nd(x, pad, ...): `pad` holds (before, after) pairs
    from the last dim back; a dim padded by neither may be split."""
    (x,) = tensors(args[:1])
    nd, pad = len(x.shape), args[1]
    grown = {nd - 1 - i // 2 for i in range(len(pad)) if pad[i]}
    sigs = [SbpSig((Shard(d),), (Shard(d),)) for d in range(nd)
            if d not in grown and x.shape[d] > 1]
    return sigs + [replicated(1, 1)]


def scatter_value(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """scatter(x, dim, index, value): a dim other than `dim` may be split on
    x and the index where they are equal (each rank writes its own rows)."""
    x, index = tensors((args, kwargs))
    nd = len(x.shape)
    dim = norm_dim(args[1], nd)
    sigs = [SbpSig((Shard(d), Shard(d)), (Shard(d),)) for d in range(nd)
            if d != dim and x.shape[d] > 1 and x.shape[d] == index.shape[d]]
    return sigs + [replicated(2, 1)]


def repeat_interleave(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """repeat_interleave(x, repeats: int, dim): along `dim` (None: the
    flattened input, so whole)."""
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim is None:
        return [replicated(1, 1)]
    return along_dim(2)(args, kwargs, outs, n)


def baddbmm(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """baddbmm(x, b1, b2) = beta x + alpha b1 @ b2, x broadcast to the
    product's [batch, rows, cols]: the batch split on all, the rows on b1,
    the columns on b2; x split where it has the dim, else whole."""
    x, b1, b2 = tensors((args, kwargs))
    out = (b1.shape[0], b1.shape[1], b2.shape[2])

    def on_x(d: int) -> Sbp:
        j = d - (3 - len(x.shape))
        return Shard(j) if j >= 0 and x.shape[j] == out[d] else R

    sigs = []
    pairs: tuple[tuple[Sbp, Sbp], ...] = ((Shard(0), Shard(0)), (Shard(1), R), (R, Shard(2)))
    for d, (s1, s2) in enumerate(pairs):
        if out[d] > 1:
            sigs.append(SbpSig((on_x(d), s1, s2), (Shard(d),)))
    return sigs + [replicated(3, 1)]


def last_two(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """tril / triu: a mask over the last two dims; the dims before them may
    be split. Linear."""
    (x,) = tensors(args[:1])
    sigs = [SbpSig((Shard(d),), (Shard(d),)) for d in range(len(x.shape) - 2) if x.shape[d] > 1]
    return sigs + [SbpSig((P,), (P,)), replicated(1, 1)]


def reduces_whole(dims_at: int, keep_at: int) -> SbpRule:
    """A reduction no Partial finishes (a norm, logsumexp, max with its
    index, var): the dims it keeps may be split, the reduced ones not.
    `dims_at`, `keep_at`: the positions of its dims and keepdim arguments
    (their keyword names `dim`, `keepdim` too); no dims: all of them."""

    def rule(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
        (x,) = tensors(args[:1])
        nd = len(x.shape)
        dims = args[dims_at] if len(args) > dims_at else kwargs.get("dim")
        dims = tuple(range(nd)) if dims in (None, ()) else (
            (dims,) if isinstance(dims, int) else tuple(dims))
        dims = {norm_dim(d, nd) for d in dims}
        keep = bool(args[keep_at]) if len(args) > keep_at else bool(kwargs.get("keepdim"))
        sigs = [SbpSig((Shard(d),), (Shard(d if keep else d - sum(r < d for r in dims)),)
                       * len(outs)) for d in range(nd) if d not in dims and x.shape[d] > 1]
        return sigs + [replicated(1, len(outs))]

    return rule


def complex_view(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """view_as_complex (the last dim, of 2, becomes the value) and
    view_as_real (a last dim of 2 appears): the other dims may be split."""
    (x,) = tensors(args[:1])
    last = len(x.shape) - (not x.dtype.name.startswith("complex"))
    sigs = [SbpSig((Shard(d),), (Shard(d),)) for d in range(last) if x.shape[d] > 1]
    return sigs + [replicated(1, 1)]
