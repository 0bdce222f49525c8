"""Counter-based random numbers: every random value a pure function of
(seed, step, the op's key, micro-batch, the element's logical index).

A rank holding a piece of a logical tensor (its box: [lo, hi) per dim)
draws exactly that piece's elements, by index, and nothing else; replicas
draw the same elements alike; a recompute draws them again; the eager
reference (`driver/same_masks.py`) draws them whole. So a random tensor
does not depend on the layout.

The generator: a keyed integer hash of the element's index, two rounds of a
xorshift-multiply mixer (the structure of MurmurHash3's finalizer) with odd
multipliers below 2^31, on int64 tensors holding 32-bit words:
`h = mix(mix(lo ^ k0) ^ mix(hi ^ k1))`, `lo`/`hi` the index's 32-bit
halves, `k0`/`k1` the key's words (of seed, step and op). The index is the
element's within its micro-batch's tensor plus micro-batch x its size: the
step's micro-batches laid end to end, so a tensor whose first dim is the
batch (or batch-major) draws each sample's numbers wherever the sample's
micro-batch boundaries fall (a resume with other micro-batches). Why not Philox (torch's on CUDA) or
torch's generators: a generator's state advances per call and per launch
configuration, so it cannot draw element i of a tensor without drawing its
predecessors; Philox itself is counter-based but needs 32x32->64-bit
products, which int64 tensors overflow. Here every product is below 2^63,
so the arithmetic is exact and the bits are the same on CPU and CUDA (the
integer ops are; `randn`'s log and cosine are float32 and may differ in
the last bits between devices).

Invariants:
- `bits(box, shape, stream)` is `bits(whole, shape, stream)` sliced to
  `box`, for any box (tested property).
- A value is drawn in chunks of at most `CHUNK` elements, so the temporary
  int64 words stay small beside the bool or float result.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

M32 = (1 << 32) - 1
_C1 = 0x7FEB352D  # odd, < 2^31: a 32-bit word times it stays below 2^63
_C2 = 0x5BD1E995
CHUNK = 1 << 18
_U24 = 1 << 24  # uniforms are 24-bit: exact in float32

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Stream:
    """One draw: its key's two words and the index of its first element."""

    key: tuple[int, int]
    offset: int = 0


@dataclass(slots=True)
class RandomCounter:
    """What a random op's key adds to its own identity: the run's seed and
    where the step stands. The executor sets `step` and `microbatch` before
    each action; plans never change per step."""

    seed: int = 0
    step: int = 0
    microbatch: int = 0

    def stream(self, op_key: int, shape: tuple[int, ...]) -> Stream:
        """Op `op_key`'s draw of a logical tensor of `shape`, this micro-batch's."""
        return Stream(key_words(self.seed, self.step, op_key),
                      self.microbatch * math.prod(shape))


def mix(x: int) -> int:
    """The mixer on one 32-bit word (Python ints): `_mix_` element-wise."""
    x ^= x >> 16
    x = (x * _C1) & M32
    x ^= x >> 15
    x = (x * _C2) & M32
    return x ^ (x >> 16)


def _mix_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """`mix` in place on an int64 tensor of 32-bit words (`tmp`: scratch of its size)."""
    for shift, mult in ((16, _C1), (15, _C2)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp))
        x.mul_(mult).bitwise_and_(M32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def key_words(*words: int) -> tuple[int, int]:
    """Two 32-bit key words folded from non-negative integers of any size."""
    out = []
    for lane in (0x9E3779B9, 0x85EBCA6B):
        h = lane
        for w in words:
            assert w >= 0, "random keys are non-negative"
            h = mix(h ^ (w & M32))
            h = mix(h ^ ((w >> 32) & M32))
        out.append(h)
    return out[0], out[1]


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return out[::-1]


def bits(box: Box, shape: tuple[int, ...], stream: Stream,
         device: torch.device | str = "cpu") -> torch.Tensor:
    """The 32-bit words (int64) of `box` of a logical tensor of `shape`."""
    out = torch.empty([b - a for a, b in box], dtype=torch.int64, device=device)
    return _fill(out, box, shape, stream, lambda w: w)


def _chunks(box: Box, shape: tuple[int, ...], stream: Stream, device):
    """(out index, its words) for each chunk of `box`: the dims before `d`
    one index at a time, dim `d` in blocks, so that a chunk holds at most
    CHUNK elements (its scratch stays in cache) and at least as many as
    whole rows past `d` allow."""
    local = [b - a for a, b in box]
    strides = _strides(shape)
    d = 0
    while d < len(local) - 1 and math.prod(local[d + 1:]) > CHUNK:
        d += 1
    row = math.prod(local[d + 1:])
    block = max(1, min(local[d], CHUNK // max(row, 1)))
    inner = _index(((0, block),) + box[d + 1:], (block,) + shape[d + 1:], strides[d:], device)
    big = stream.offset + math.prod(shape) > M32  # the index's high word varies
    k0, k1 = stream.key
    high = mix(k1)  # mix(hi ^ k1) for hi == 0
    tmp = torch.empty_like(inner)
    starts = range(box[d][0], box[d][1], block)
    for idx in itertools.product(*(range(a, b) for a, b in box[:d]), starts):
        at = idx[-1]
        n = min(block, box[d][1] - at)
        base = stream.offset + sum(i * st for i, st in zip(idx, strides))
        x, scratch = inner[:n].add(base), tmp[:n]
        if big:
            hi = _mix_(x.bitwise_right_shift(32).bitwise_xor_(k1), scratch)
            x.bitwise_and_(M32).bitwise_xor_(k0)
            _mix_(x, scratch).bitwise_xor_(hi)
        else:
            _mix_(x.bitwise_xor_(k0), scratch).bitwise_xor_(high)
        pos = tuple(i - a for i, (a, _) in zip(idx[:-1], box))
        yield pos + (slice(at - box[d][0], at - box[d][0] + n),), _mix_(x, scratch)


def _index(box: Box, shape, strides: list[int], device) -> torch.Tensor:
    """Each element's linear index in a tensor of `shape` (strides `strides`)
    over `box`: one range where the box is whole past its first dim."""
    if all(box[d] == (0, shape[d]) for d in range(1, len(box))):
        a, b = box[0]
        return torch.arange(a * strides[0], b * strides[0], dtype=torch.int64,
                            device=device).view([b - a, *shape[1:]])
    out = torch.zeros((), dtype=torch.int64, device=device)
    for (a, b), s in zip(box, strides):
        out = out.unsqueeze(-1) + torch.arange(a, b, dtype=torch.int64, device=device) * s
    return out


def _fill(out: torch.Tensor, box: Box, shape: tuple[int, ...], stream: Stream,
          finish) -> torch.Tensor:
    if not box:  # a scalar: the one element of a 1-element vector
        _fill(out.view(1), ((0, 1),), (1,), stream, finish)
        return out
    for pos, words in _chunks(box, shape, stream, out.device):
        out[pos].copy_(finish(words))
    return out


def keep_mask(box: Box, shape: tuple[int, ...], p: float, stream: Stream,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Dropout's keep mask (bool): kept with probability 1 - p (to 2^-24)."""
    threshold = round(p * _U24) << 8  # the word's top 24 bits at or above p * 2^24
    out = torch.empty([b - a for a, b in box], dtype=torch.bool, device=device)
    return _fill(out, box, shape, stream, lambda w: w >= threshold)


def uniform(box: Box, shape: tuple[int, ...], stream: Stream, dtype: torch.dtype,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform in [0, 1), 24 random bits each."""
    out = torch.empty([b - a for a, b in box], dtype=dtype, device=device)
    return _fill(out, box, shape, stream,
                 lambda w: (w >> 8).to(torch.float32).mul_(1.0 / _U24))


def normal(box: Box, shape: tuple[int, ...], stream: Stream, dtype: torch.dtype,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal by Box-Muller, from two uniforms of two keys."""
    u1 = uniform(box, shape, stream, torch.float32, device)
    u2 = uniform(box, shape, Stream(key_words(*stream.key, 1), stream.offset), torch.float32,
                 device)
    r = torch.sqrt(-2.0 * torch.log1p(-u1))
    return (r * torch.cos((2 * math.pi) * u2)).to(dtype)


def integers(box: Box, shape: tuple[int, ...], stream: Stream, low: int, high: int,
             dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Integers in [low, high) (modulo a 32-bit word: a bias below
    (high - low) / 2^32)."""
    assert 0 < high - low <= M32
    out = torch.empty([b - a for a, b in box], dtype=dtype, device=device)
    return _fill(out, box, shape, stream, lambda w: w.remainder_(high - low).add_(low))


def whole(shape) -> Box:
    return tuple((0, n) for n in shape)
