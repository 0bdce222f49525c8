"""Cross-placement transfers: which slice boxes go from which rank to which.

Invariants:
- Pieces are computed from intersecting slice boxes, so any source and
  destination placement (different rank counts, different SBPs, uneven
  splits) works, and each destination rank receives exactly its own box,
  once: the pieces for a destination rank tile its box.
- When several source ranks hold the same data (Replicate axes), the piece
  comes from replica number `dst_index % replicas`, spreading the load.
- Cost per rank is O(peers): `recv_pieces` looks at the source shards only,
  `send_pieces` at the destination ranks only; nothing enumerates the
  cluster's full transfer table.
- Partial sources must be reduced before a transfer (the boxing pass does).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from meshplan.ir.mesh import Placement
from meshplan.ir.sbp import Box, NdSbp, Partial, Shard, intersect, local_box


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


def _shard_coords(place: Placement, sbp: NdSbp) -> list[tuple[int, ...]]:
    """One coordinate per distinct source slice (0 on non-Shard axes)."""
    ranges = [range(n) if isinstance(s, Shard) else range(1) for n, s in zip(place.grid, sbp)]
    return list(itertools.product(*ranges))


def recv_pieces(shape, src: Placement, src_sbp: NdSbp, dst: Placement, dst_sbp: NdSbp,
                dst_rank: int) -> list[Piece]:
    """The pieces destination `dst_rank` receives, in a deterministic order."""
    assert not any(isinstance(s, Partial) for s in src_sbp), "reduce Partial before transfer"
    want = local_box(shape, dst_sbp, dst.grid, dst.coord(dst_rank))
    index = dst.ranks.index(dst_rank)
    out = []
    for c in _shard_coords(src, src_sbp):
        part = intersect(want, local_box(shape, src_sbp, src.grid, c))
        if part is None:
            continue
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
    for index, d in enumerate(dst.ranks):
        if reps[index % len(reps)] != src_rank:
            continue
        part = intersect(have, local_box(shape, dst_sbp, dst.grid, dst.coord(d)))
        if part is not None:
            out.append(Piece(src_rank, d, part))
    return out
