"""The eager reference's random ops, drawing meshplan's numbers.

`SameMasks(seed)` is a `TorchFunctionMode` for the reference only: inside
`at(step, microbatch)` the user's eager module runs as written, but each
random call (`F.dropout`, attention's `dropout_p`, `torch.rand`/`randn`/
`randint`/`bernoulli` and their `_like` forms, and the in-place `uniform_`,
`exponential_`, `normal_` and `bernoulli_`) draws from the
counter-based generator (`ops/counter_rng.py`) under the key meshplan's op
has: its ordinal among the forward's random calls, in program order (as
capture numbers them, `ops/random_ops.py`). The draws are whole tensors;
the ranks draw their pieces of the same ones. Outside the mode the module
draws from torch's own generator, as stock PyTorch does.

With `flip` (the micro-batch's rows), a draw whose first dim has that size
is reversed along it, and one whose first dim is a multiple of it (a
routing's draw over the batch's tokens, flattened sample-major: PhiMoE's)
has its blocks reversed: the masks of verify's twin reference, which trains
on each micro-batch's samples in reverse order (`verify.reordered`), follow
their samples.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshplan.ops import counter_rng as rng
from meshplan.ops import random_ops as ro
from meshplan.ops.resolve import resolve_op


class SameMasks(TorchFunctionMode):
    """Random calls keyed as meshplan keys them (see the module docstring)."""

    def __init__(self, seed: int = 0, flip: int = 0):
        super().__init__()
        self.counter = rng.RandomCounter(seed)
        self.calls = 0
        self.flip = flip

    @contextmanager
    def at(self, step: int, microbatch: int):
        """The module's forward of micro-batch `microbatch` of step `step`."""
        self.counter.step, self.counter.microbatch, self.calls = step, microbatch, 0
        with self:
            yield self

    def _draw(self, shape) -> dict:
        shape = tuple(int(n) for n in shape)
        stream = self.counter.stream(self.calls, shape)
        self.calls += 1
        return {"box": rng.whole(shape), "shape": shape, "stream": stream}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(self, *args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """A draw in the twin's sample order (see the module docstring)."""
        if not (self.flip and t.dim() and t.shape[0] and t.shape[0] % self.flip == 0):
            return t
        return t.unflatten(0, (self.flip, -1)).flip(0).flatten(0, 1)


def _dropout(m: SameMasks, x, p=0.5, training=True, inplace=False):
    if p == 0 or not training:
        return x
    if p >= 1:
        out = torch.zeros_like(x)
    else:  # the arithmetic of `random_ops.dropout_kernel`
        d = m._draw(x.shape)
        mask = m._rows(rng.keep_mask(d["box"], d["shape"], p, d["stream"], x.device))
        out = x.mul(mask).mul_(1.0 / (1.0 - p))
    return x.copy_(out) if inplace else out


def _attention(m: SameMasks, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
               scale=None, enable_gqa=False):
    if not dropout_p:
        return NotImplemented
    opts = {"attn_mask": attn_mask, "is_causal": is_causal, "scale": scale,
            "enable_gqa": enable_gqa}
    return ro.attention_math(
        lambda kind, *a, **kw: resolve_op(kind)(*a, **kw),
        lambda t: (tuple(t.shape), t.dtype == torch.bool), q, k, v, opts,
        lambda a: _dropout(m, a, dropout_p), {"bool": torch.bool, "device": q.device})


def _uniform(m: SameMasks, x) -> torch.Tensor:
    d = m._draw(x.shape)
    return m._rows(rng.uniform(d["box"], d["shape"], d["stream"], torch.float32, x.device))


def _like(dist: str):
    def draw(m: SameMasks, x, *, dtype=None, **_kw):
        if dist == "uniform":
            return _uniform(m, x).to(dtype or x.dtype)
        d = m._draw(x.shape)
        return m._rows(rng.normal(d["box"], d["shape"], d["stream"], dtype or x.dtype, x.device))
    return draw


def _bernoulli(m: SameMasks, x, p=None, *, generator=None, **_kw):
    """`random_ops.random_like_kernel`'s "bernoulli" and "bernoulli_p"."""
    return (_uniform(m, x) < (x if p is None else float(p))).to(x.dtype)


def _in_place(dist: str):
    """`x.uniform_(a, b)`, `x.exponential_(lambd)`, `x.normal_(mean, std)`:
    the arithmetic of their capture (`random_ops.distribution`)."""
    def draw(m: SameMasks, x, *args, generator=None, **kw):
        base = _like(ro.DISTRIBUTIONS[dist][0])(m, x)
        out = ro.distribution(lambda kind, *a: resolve_op(kind)(*a), base, dist,
                              ro.params_of(dist, (x, *args), kw))
        return x.copy_(out)
    return draw


def _bernoulli_in_place(m: SameMasks, x, p=0.5, *, generator=None):
    return x.copy_(_bernoulli(m, x, p))


def _size(size) -> tuple[int, ...]:
    return tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) \
        else tuple(size)


def _shaped(dist: str):
    def draw(m: SameMasks, *size, dtype=None, device=None, **_kw):
        shape = _size(size)
        d = m._draw(shape)
        make = rng.normal if dist == "normal" else rng.uniform
        return m._rows(make(d["box"], d["shape"], d["stream"], dtype or torch.get_default_dtype(),
                            device or "cpu"))
    return draw


def _randint(m: SameMasks, *args, dtype=None, device=None, **_kw):
    low, high, size = (0, *args) if len(args) == 2 else args
    shape = _size((size,))
    d = m._draw(shape)
    return m._rows(rng.integers(d["box"], d["shape"], d["stream"], int(low), int(high),
                                dtype or torch.int64, device or "cpu"))


_HANDLERS = {
    F.dropout: _dropout, torch.dropout: _dropout,
    F.scaled_dot_product_attention: _attention,
    torch.rand_like: _like("uniform"), torch.randn_like: _like("normal"),
    torch.bernoulli: _bernoulli, torch.Tensor.bernoulli: _bernoulli,
    torch.rand: _shaped("uniform"), torch.randn: _shaped("normal"),
    torch.randint: _randint,
    torch.Tensor.uniform_: _in_place("uniform"),
    torch.Tensor.exponential_: _in_place("exponential"),
    torch.Tensor.normal_: _in_place("normal"),
    torch.Tensor.bernoulli_: _bernoulli_in_place,
}
