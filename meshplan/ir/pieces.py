"""Cross-placement transfers: which slice boxes go from which rank to which.

Invariants:
- Pieces are computed from intersecting slice boxes, so any source and
  destination placement (different rank counts, different SBPs, uneven
  splits) works, and each destination rank receives exactly its own box,
  once: the pieces for a destination rank tile its box.
- When several source ranks hold the same data (Replicate axes), the piece
  comes from replica number `dst_index % replicas`, spreading the load.
- Cost per rank is O(peers): `recv_pieces` and `send_pieces` walk the other
  placement's grid axis by axis, keeping along a split axis only the parts
  meeting the rank's own box (found by bisection), so a stage of 8192 ranks
  costs a rank its few peers, not 8192 boxes; nothing enumerates the
  cluster's full transfer table.
- Partial sources must be reduced before a transfer (the boxing pass does).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from meshplan.ir.mesh import Placement
from meshplan.ir.sbp import Box, NdSbp, Partial, Shard, intersect, local_box, split_range


@dataclass(frozen=True, slots=True)
class Piece:
    """`box` (logical coordinates) goes from rank `src` to rank `dst`."""

    src: int
    dst: int
    box: Box


def _replicas(place: Placement, sbp: NdSbp, coord: tuple[int, ...]) -> list[int]:
    """Ranks holding the same slice as `coord` (differing only on non-Shard axes)."""
    free = [a for a, s in enumerate(sbp) if not isinstance(s, Shard)]
    out = []
    for vals in itertools.product(*(range(place.grid[a]) for a in free)):
        c = list(coord)
        for a, v in zip(free, vals):
            c[a] = v
        out.append(place.rank_at(tuple(c)))
    return out


def _meeting(shape, sbp: NdSbp, grid: tuple[int, ...], want: Box,
             replicas: bool) -> list[tuple[tuple[int, ...], Box]]:
    """(coordinate, its slice's common part with `want`) for each grid
    coordinate whose slice of a tensor of `shape` laid out `sbp` meets
    `want`, in row-major order; along a non-Shard axis every index
    (`replicas`) or index 0 only."""
    out: list[tuple[tuple[int, ...], Box]] = []

    def walk(axis: int, box: Box, coord: tuple[int, ...]) -> None:
        if axis == len(grid):
            part = intersect(box, want)
            if part is not None:
                out.append((coord, part))
            return
        s, n = sbp[axis], grid[axis]
        if not isinstance(s, Shard):
            for k in range(n) if replicas else range(1):
                walk(axis + 1, box, coord + (k,))
            return
        lo, hi = box[s.dim]
        for k in _parts_meeting(hi - lo, n, want[s.dim][0] - lo, want[s.dim][1] - lo):
            a, b = split_range(hi - lo, n, k)
            walk(axis + 1, box[:s.dim] + ((lo + a, lo + b),) + box[s.dim + 1:], coord + (k,))

    walk(0, tuple((0, n) for n in shape), ())
    return out


def _parts_meeting(size: int, parts: int, lo: int, hi: int) -> range:
    """The parts k of `split_range(size, parts, k)` that may meet [lo, hi):
    from the first ending after `lo` to the last starting before `hi`."""
    first = bisect.bisect_right(range(parts), lo, key=lambda k: split_range(size, parts, k)[1])
    last = bisect.bisect_left(range(parts), hi, key=lambda k: split_range(size, parts, k)[0])
    return range(first, max(first, last))


def recv_pieces(shape, src: Placement, src_sbp: NdSbp, dst: Placement, dst_sbp: NdSbp,
                dst_rank: int) -> list[Piece]:
    """The pieces destination `dst_rank` receives, in a deterministic order."""
    assert not any(isinstance(s, Partial) for s in src_sbp), "reduce Partial before transfer"
    want = local_box(shape, dst_sbp, dst.grid, dst.coord(dst_rank))
    index = dst.ranks.index(dst_rank)
    out = []
    for c, part in _meeting(shape, src_sbp, src.grid, want, replicas=False):
        reps = _replicas(src, src_sbp, c)
        out.append(Piece(reps[index % len(reps)], dst_rank, part))
    return out


def send_pieces(shape, src: Placement, src_sbp: NdSbp, dst: Placement, dst_sbp: NdSbp,
                src_rank: int) -> list[Piece]:
    """The pieces source `src_rank` sends, in destination-rank order."""
    assert not any(isinstance(s, Partial) for s in src_sbp), "reduce Partial before transfer"
    coord = src.coord(src_rank)
    have = local_box(shape, src_sbp, src.grid, coord)
    reps = _replicas(src, src_sbp, coord)
    out = []
    for c, part in _meeting(shape, dst_sbp, dst.grid, have, replicas=True):
        index = _flat(c, dst.grid)
        if reps[index % len(reps)] == src_rank:
            out.append(Piece(src_rank, dst.ranks[index], part))
    return out


def _flat(coord: tuple[int, ...], grid: tuple[int, ...]) -> int:
    i = 0
    for c, n in zip(coord, grid):
        i = i * n + c
    return i
