"""Random ops, layout-invariant: dropout (attention's too, its math as aten
ops), and the draws of `rand`/`randn`/`randint`/`bernoulli` and of the
in-place `uniform_`/`exponential_`/`normal_`, as meshplan ops whose numbers
come from the counter-based generator (`counter_rng.py`).

Invariants:
- Capture gives each random op a key, its ordinal among the forward's
  random ops in program order (`canonical` rewrites call `ctx.random_key()`);
  the eager reference counts its calls the same way (`driver/same_masks.py`).
  The key is a literal of the op: passes keep it, a recompute's clone
  copies it, so a clone draws the same numbers.
- A kernel draws the box of its output it holds (`box`: [lo, hi) per dim
  of the logical `shape`) from the stream of (seed, step, op key,
  micro-batch): `runtime/bind.py` binds them per rank; the logical kernel here
  draws the whole tensor at step 0, micro-batch 0, seed 0.
- Any other op that draws from torch's generator is refused at capture
  (`draws`): its numbers would depend on the rank and the layout.
- Dropout's output follows its input's layout; a Partial input stays
  Partial (dropout is linear in x, every holder draws the same mask) and
  its mask is Replicate. A draw with no input (`rand(shape)`) is Replicate.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshplan.ir import DEVICE, DType, Ref, TensorMeta
from meshplan.ir.kinds import DROPOUT, RANDOM, RANDOM_LIKE
from meshplan.ir.sbp import Shard
from meshplan.ops import counter_rng as rng
from meshplan.ops.rule import Emits
from meshplan.ops.sbp_rules import pointwise
from meshplan.ops.sbp_sig import Outs, P, R, SbpSig, replicated, tensors

Draw = dict  # box, shape, stream, as `runtime/bind.py` binds them


def _draw(shape, key: int, draw: Draw | None) -> tuple:
    if draw is None:  # the logical kernel: the whole tensor, seed 0, step 0, micro-batch 0
        return rng.whole(shape), tuple(shape), rng.RandomCounter().stream(key, tuple(shape))
    return draw["box"], draw["shape"], draw["stream"]


# ------------------------------------------------------------------ kernels
def dropout_kernel(x: torch.Tensor, p: float, key: int, *, draw: Draw | None = None):
    """(x * mask * 1/(1-p), mask): the arithmetic of aten's `native_dropout`."""
    box, shape, stream = _draw(x.shape, key, draw)
    mask = rng.keep_mask(box, shape, p, stream, x.device)
    return x.mul(mask).mul_(1.0 / (1.0 - p)), mask


def random_like_kernel(x: torch.Tensor, dist: str, p: float, key: int, *,
                       draw: Draw | None = None) -> torch.Tensor:
    """`rand_like` ("uniform"), `randn_like` ("normal"), `bernoulli(x)`
    ("bernoulli": x the probabilities) and `bernoulli(x, p)` ("bernoulli_p")."""
    box, shape, stream = _draw(x.shape, key, draw)
    if dist == "normal":
        return rng.normal(box, shape, stream, x.dtype, x.device)
    u = rng.uniform(box, shape, stream, torch.float32, x.device)
    if dist == "uniform":
        return u.to(x.dtype)
    return (u < (x if dist == "bernoulli" else p)).to(x.dtype)


def random_kernel(size, dist: str, low: int, high: int, dtype: Any, key: int, *,
                  device: Any = None, draw: Draw | None = None) -> torch.Tensor:
    """`rand` / `randn` / `randint` of a shape."""
    box, shape, stream = _draw(tuple(size), key, draw)
    dtype = dtype or torch.get_default_dtype()
    if dist == "integers":
        return rng.integers(box, shape, stream, low, high, dtype, device or "cpu")
    make = rng.normal if dist == "normal" else rng.uniform
    return make(box, shape, stream, dtype, device or "cpu")


KERNELS = {DROPOUT: dropout_kernel, RANDOM_LIKE: random_like_kernel, RANDOM: random_kernel}


# ------------------------------------------------------------------ inference
def dropout_infer(a: tuple, kw: dict) -> tuple[TensorMeta, ...]:
    return a[0], TensorMeta(a[0].shape, DType("bool"))


def random_like_infer(a: tuple, kw: dict) -> tuple[TensorMeta, ...]:
    return (a[0],)


def random_infer(a: tuple, kw: dict) -> tuple[TensorMeta, ...]:
    dtype = a[4] if a[4] is not None else DType.of(torch.get_default_dtype())
    return (TensorMeta(tuple(a[0]), dtype),)


# ------------------------------------------------------------------ SBP
def dropout_sbp(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """A shard passes through; a Partial stays Partial, its mask the same on
    every holder (Replicate)."""
    (x,) = tensors((args, kwargs))
    sigs = [SbpSig((Shard(d),), (Shard(d), Shard(d))) for d in range(len(x.shape))
            if x.shape[d] > 1]
    return sigs + [SbpSig((P,), (P, R)), replicated(1, 2)]


def follow_sbp(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """A draw shaped like its input, which it does not read: the input's
    shard; Partial or not, the draw is whole."""
    (x,) = tensors((args, kwargs))
    return [SbpSig((Shard(d),), (Shard(d),)) for d in range(len(x.shape)) if x.shape[d] > 1] \
        + [SbpSig((P,), (R,)), replicated(1, 1)]


def random_like_sbp(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    if args[1] == "bernoulli":  # reads the probabilities: an elementwise op
        return pointwise()(args, kwargs, outs, n)
    return follow_sbp(args, kwargs, outs, n)


# ------------------------------------------------------------------ capture
def dropout(e: Emits, x: Ref, p: float, ctx: Any) -> tuple[Ref, Ref]:
    """Dropout of x with probability p (0 < p < 1) as `meshplan.dropout`."""
    if p >= 1:  # everything dropped: zeros, and no mask to draw
        zeros = e.call("aten.zeros_like.default", x)
        return zeros, e.call("aten.zeros_like.default", x, dtype=DType("bool"))
    out, mask = e.call_multi(DROPOUT, x, float(p), ctx.random_key())
    return out, mask


def attention(e: Emits, q: Ref, k: Ref, v: Ref, opts: dict, ctx: Any) -> Ref:
    """scaled_dot_product_attention with dropout: `attention_math`'s aten
    ops, the dropout of the attention weights a `meshplan.dropout` (the
    fused kernels draw their own mask, from torch's generator, by launch
    layout)."""
    p = float(opts["dropout_p"])
    return attention_math(e.call, lambda r: (e.meta(r).shape, e.meta(r).dtype.name == "bool"),
                          q, k, v, opts,
                          lambda a: dropout(e, a, p, ctx)[0],
                          {"bool": DType("bool"), "device": DEVICE})


def attention_math(call, info, q, k, v, opts: dict, drop, lit: dict):
    """Attention as aten ops (`call(kind, *args, **kwargs)`; `info(x)`: x's
    shape and whether it is bool), the math of aten's
    `_scaled_dot_product_attention_math`: softmax((q * scale) k^T + mask),
    `drop` applied, times v. Capture emits it; the eager reference
    (`driver/same_masks.py`) runs it, so both compute alike."""
    qs, ks = info(q)[0], info(k)[0]
    scale = opts.get("scale") or 1.0 / math.sqrt(qs[-1])
    if opts.get("enable_gqa") and len(qs) > 2 and qs[-3] != ks[-3]:
        k = call("aten.repeat_interleave.self_int", k, qs[-3] // ks[-3], -3)
        v = call("aten.repeat_interleave.self_int", v, qs[-3] // ks[-3], -3)
    q = call("aten.mul.Tensor", q, scale)  # q (.., L, E) is smaller than the scores (.., L, S)
    s = call("aten.matmul.default", q, call("aten.transpose.int", k, -2, -1))
    mask = opts.get("attn_mask")
    if opts.get("is_causal"):  # torch refuses a mask beside it
        ones = call("aten.ones.default", (qs[-2], ks[-2]), dtype=lit["bool"],
                    device=lit["device"])
        mask = call("aten.tril.default", ones)
    if mask is not None and info(mask)[1]:
        s = call("aten.masked_fill.Scalar", s, call("aten.logical_not.default", mask),
                 float("-inf"))
    elif mask is not None:
        s = call("aten.add.Tensor", s, mask)
    return call("aten.matmul.default", drop(call("aten._softmax.default", s, -1, False)), v)


def native_dropout(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    x, p = args[0], args[1]
    train = args[2] if len(args) > 2 else kw.get("train", True)
    if p == 0 or train is False:  # off: x itself, every element kept
        return x, e.call("aten.ones_like.default", x, dtype=DType("bool"))
    return dropout(e, x, p, ctx)


def bernoulli(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    """`bernoulli(x)` (x the probabilities) or `bernoulli(x, p)`."""
    p = args[1] if len(args) > 1 else kw.get("p")
    dist = "bernoulli" if p is None else "bernoulli_p"
    return (e.call(RANDOM_LIKE, args[0], dist, float(p or 0.0), ctx.random_key()),)


def _like(dist: str):
    def rewrite(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
        x = args[0]
        if kw.get("dtype") not in (None, e.meta(x).dtype):
            x = e.call("aten._to_copy.default", x, dtype=kw["dtype"])
        return (e.call(RANDOM_LIKE, x, dist, 0.0, ctx.random_key()),)
    return rewrite


def _shaped(dist: str, bounds: int):
    """rand(size) / randn(size) (`bounds` 0), randint(high, size) (1),
    randint(low, high, size) (2)."""
    def rewrite(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
        low, high = (0, args[0]) if bounds == 1 else (args[0], args[1]) if bounds else (0, 0)
        size = tuple(args[bounds])
        dtype = kw.get("dtype") or (DType("int64") if dist == "integers" else None)
        return (e.call(RANDOM, size, dist, int(low), int(high), dtype, ctx.random_key(),
                       device=kw.get("device")),)
    return rewrite


# the distributions of the in-place draws (`x.uniform_(a, b)`, `exponential_`,
# `normal_`), by their functional ops' names: (the draw they transform, their
# parameters' names, defaults)
DISTRIBUTIONS = {
    "uniform": ("uniform", ("from", "to"), (0.0, 1.0)),
    "exponential": ("uniform", ("lambd",), (1.0,)),
    "normal": ("normal", ("mean", "std"), (0.0, 1.0)),
}


def distribution(call, draw, dist: str, params: tuple[float, ...]):
    """`draw` (uniform on [0, 1), or standard normal for "normal"), as
    `dist`'s numbers by aten ops (`call(kind, *args)`): a + (b - a) u,
    -log(1 - u) / lambd, mean + std n. Capture emits them; the eager
    reference (`driver/same_masks.py`) runs them, so both compute alike."""
    if dist == "exponential":
        log = call("aten.log1p.default", call("aten.neg.default", draw))
        return call("aten.mul.Tensor", log, -1.0 / params[0])
    a, b = params
    scale = b - a if dist == "uniform" else b
    return call("aten.add.Tensor", call("aten.mul.Tensor", draw, scale), a)


def params_of(dist: str, args: tuple, kw: dict) -> tuple[float, ...]:
    """A distribution op's parameters, positional or named, else defaults."""
    _, names, defaults = DISTRIBUTIONS[dist]
    return tuple(float(args[i] if i < len(args) else kw.get(n, d))
                 for i, (n, d) in enumerate(zip(names, defaults), start=1))


def _distribution(dist: str):
    def rewrite(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
        draw = e.call(RANDOM_LIKE, args[0], DISTRIBUTIONS[dist][0], 0.0, ctx.random_key())
        return (distribution(e.call, draw, dist, params_of(dist, args, kw)),)
    return rewrite


def draws(op, args: tuple, kwargs: dict) -> bool:
    """Whether aten op `op` (the fx target) draws from torch's generator
    with these arguments: it is seeded, and no dropout probability of 0 or
    `train=False` turns its draw off (an LSTM without dropout does not)."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    named = dict(kwargs)
    named.update((a.name, v) for a, v in zip(op._schema.arguments, args))
    if named.get("train", named.get("training", True)) is False:
        return False
    return named.get("dropout", named.get("dropout_p", 1)) != 0


CANONICAL = {
    "aten.uniform.default": _distribution("uniform"),
    "aten.exponential.default": _distribution("exponential"),
    "aten.normal_functional.default": _distribution("normal"),
    "aten.native_dropout.default": native_dropout,
    "aten.bernoulli.default": bernoulli,
    "aten.bernoulli.p": bernoulli,
    "aten.rand_like.default": _like("uniform"),
    "aten.randn_like.default": _like("normal"),
    "aten.rand.default": _shaped("uniform", 0),
    "aten.randn.default": _shaped("normal", 0),
    "aten.randint.default": _shaped("integers", 1),
    "aten.randint.low": _shaped("integers", 2),
}
