"""SBP: how a logical tensor lives on the ranks of one mesh axis.

Invariants:
- `Shard(dim)`: split along `dim` into near-equal contiguous parts (the
  first `size % n` parts one longer), part `i` on the axis's `i`-th rank.
- `Replicate()`: every rank holds the whole tensor.
- `Partial(op)`: every rank holds a tensor of the full shape; the logical
  value is their reduction by `op` ("sum" or "max").
- An N-D SBP (`NdSbp`) has one entry per axis of a placement's rank grid,
  outermost first. Shards on several axes of one dim nest: the outer axis
  splits first, the inner axis splits each part again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    op: str = "sum"

    def __str__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"


Sbp = Union[Shard, Replicate, Partial]
NdSbp = tuple[Sbp, ...]
R = Replicate()
P = Partial()


def split_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when `size` splits into `parts` near-equal parts."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


Box = tuple[tuple[int, int], ...]


def local_box(shape: tuple[int, ...], sbp: NdSbp, grid: tuple[int, ...],
              coord: tuple[int, ...]) -> Box:
    """The slice of a logical tensor of `shape` held at grid coordinate `coord`."""
    box = tuple((0, s) for s in shape)
    for axis, s in enumerate(sbp):
        box = split_axis(box, s, grid[axis], coord[axis])
    return box


def split_axis(box: Box, s, parts: int, index: int) -> Box:
    """`box` cut by layout `s` of one mesh axis: part `index` of `parts`."""
    if not isinstance(s, Shard):
        return box
    lo, hi = box[s.dim]
    a, b = split_range(hi - lo, parts, index)
    return box[:s.dim] + ((lo + a, lo + b),) + box[s.dim + 1:]


def distinct_local_shapes(tensors: list[tuple[tuple[int, ...], NdSbp]],
                          grid: tuple[int, ...]) -> set[tuple[tuple[int, ...], ...]]:
    """Every distinct tuple of local shapes that `tensors` ((shape, sbp) each)
    have together at one grid coordinate. Axis by axis, only sizes are kept
    (a later cut depends on a part's size, not its place), and along an axis
    only the indices where some part's size changes are visited: a part of a
    cut into `n` is one longer below `size % n`, so the indices 0 and each
    such remainder stand for all. The work is O(axes x distinct cuts x
    tensors), not the number of coordinates (a 1024 x 8 grid of even
    shards: 2 cuts, not 8192)."""
    states = {tuple(shape for shape, _ in tensors)}
    for axis, parts in enumerate(grid):
        new = set()
        for st in states:
            cuts = [(i, s.dim) for i, (_, sbp) in enumerate(tensors)
                    if isinstance(s := sbp[axis], Shard)]
            steps = {0} | {st[i][d] % parts for i, d in cuts} - {parts}
            for k in steps:
                cut = [list(shape) for shape in st]
                for i, d in cuts:
                    a, b = split_range(st[i][d], parts, k)
                    cut[i][d] = b - a
                new.add(tuple(tuple(shape) for shape in cut))
        states = new
    return states


def local_shape(shape: tuple[int, ...], sbp: NdSbp, grid: tuple[int, ...],
                coord: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the local tensor at `coord`."""
    return tuple(b - a for a, b in local_box(shape, sbp, grid, coord))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None if they do not overlap."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def fmt(sbp: NdSbp) -> str:
    """`(S(0), R)` -> `S(0)R`: the compact form used in reports and goldens."""
    return "".join(str(s) for s in sbp)
