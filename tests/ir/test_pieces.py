"""Cross-placement pieces: each destination's pieces tile its box, senders agree, data moves."""

import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.ir.mesh import Placement
from meshplan.ir.pieces import Piece, recv_pieces, send_pieces
from meshplan.ir.sbp import Partial, R, Shard, box_numel, intersect, local_box

SRC3 = Placement((0, 1, 2), (3,))
DST5 = Placement((3, 4, 5, 6, 7), (5,))


def _box_of(place, sbp, shape, rank):
    return local_box(shape, sbp, place.grid, place.coord(rank))


def _within(inner, outer):
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))


def _slices(box, origin=None):
    origin = origin or tuple((0, 0) for _ in box)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def _check_transfer(shape, src, src_sbp, dst, dst_sbp):
    """Tiling, source ownership and send/recv agreement; returns all pieces."""
    received = []
    for d in dst.ranks:
        want = _box_of(dst, dst_sbp, shape, d)
        pieces = recv_pieces(shape, src, src_sbp, dst, dst_sbp, d)
        assert pieces == recv_pieces(shape, src, src_sbp, dst, dst_sbp, d)  # deterministic
        counter = torch.zeros(shape, dtype=torch.int64)
        for p in pieces:
            assert isinstance(p, Piece) and p.dst == d
            assert p.src in src.ranks
            assert box_numel(p.box) > 0
            assert _within(p.box, want)
            assert _within(p.box, _box_of(src, src_sbp, shape, p.src))
            counter[_slices(p.box)] += 1
        inside = torch.zeros(shape, dtype=torch.int64)
        inside[_slices(want)] = 1
        assert torch.equal(counter, inside)  # no overlap, union = box
        received += pieces
    sent = []
    for s in src.ranks:
        pieces = send_pieces(shape, src, src_sbp, dst, dst_sbp, s)
        assert all(p.src == s for p in pieces)
        assert [dst.ranks.index(p.dst) for p in pieces] == sorted(
            dst.ranks.index(p.dst) for p in pieces)
        sent += pieces
    assert Counter(received) == Counter(sent)
    return received


def _move(shape, src, src_sbp, dst, dst_sbp, seed):
    """Slice a random tensor onto the sources, assemble each destination from pieces."""
    logical = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    held = {s: logical[_slices(_box_of(src, src_sbp, shape, s))].clone() for s in src.ranks}
    for d in dst.ranks:
        want = _box_of(dst, dst_sbp, shape, d)
        local = torch.full([b - a for a, b in want], float("nan"))
        for p in recv_pieces(shape, src, src_sbp, dst, dst_sbp, d):
            src_box = _box_of(src, src_sbp, shape, p.src)
            local[_slices(p.box, want)] = held[p.src][_slices(p.box, src_box)]
        assert torch.equal(local, logical[_slices(want)])


# -- the case: 3 ranks -> 5 ranks, uneven ----------------------------------

shapes_dim0 = st.tuples(st.integers(1, 64)).flatmap(
    lambda d0: st.lists(st.integers(1, 5), max_size=2).map(lambda rest: d0 + tuple(rest)))


@pytest.mark.parametrize("dst_sbp", [(Shard(0),), (R,)], ids=["S0", "R"])
@settings(max_examples=60, deadline=None)
@given(shape=shapes_dim0, seed=st.integers(0, 2**16))
def test_three_to_five(dst_sbp, shape, seed):
    _check_transfer(shape, SRC3, (Shard(0),), DST5, dst_sbp)
    _move(shape, SRC3, (Shard(0),), DST5, dst_sbp, seed)


def _dim0_len(place, shape, rank):
    (a, b), *_ = _box_of(place, (Shard(0),), shape, rank)
    return b - a


@settings(max_examples=64, deadline=None)
@given(shape=shapes_dim0)
def test_three_to_five_peers(shape):
    """O(peers): a box meets at most ceil(len / min other len) + 1 shards of the other side."""
    pieces = _check_transfer(shape, SRC3, (Shard(0),), DST5, (Shard(0),))
    n = shape[0]
    src_lens = [_dim0_len(SRC3, shape, r) for r in SRC3.ranks]
    dst_lens = [_dim0_len(DST5, shape, r) for r in DST5.ranks]
    min_src = min(x for x in src_lens if x)
    min_dst = min(x for x in dst_lens if x)
    for d, length in zip(DST5.ranks, dst_lens):
        peers = {p.src for p in pieces if p.dst == d}
        assert len(peers) <= 2
        assert len(peers) <= math.ceil(length / min_src) + 1
    for s, length in zip(SRC3.ranks, src_lens):
        peers = {p.dst for p in pieces if p.src == s}
        assert len(peers) <= 3
        assert len(peers) <= math.ceil(length / min_dst) + 1
    assert sum(box_numel(p.box) for p in pieces) == n * math.prod(shape[1:])


def test_three_to_five_explicit():
    # dim 0 = 7: sources [0,3) [3,5) [5,7); destinations [0,2) [2,4) [4,5) [5,6) [6,7)
    shape = (7, 2)
    got = [recv_pieces(shape, SRC3, (Shard(0),), DST5, (Shard(0),), d) for d in DST5.ranks]
    assert got == [
        [Piece(0, 3, ((0, 2), (0, 2)))],
        [Piece(0, 4, ((2, 3), (0, 2))), Piece(1, 4, ((3, 4), (0, 2)))],
        [Piece(1, 5, ((4, 5), (0, 2)))],
        [Piece(2, 6, ((5, 6), (0, 2)))],
        [Piece(2, 7, ((6, 7), (0, 2)))],
    ]


# -- random placements ----------------------------------------------------------------


@st.composite
def transfers(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    kinds = st.one_of(st.builds(Shard, st.integers(0, len(shape) - 1)), st.just(R))

    def placement(first):
        grid = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
        ranks = draw(st.permutations(range(first, first + math.prod(grid))))
        return Placement(tuple(ranks), grid), tuple(draw(kinds) for _ in grid)

    src, src_sbp = placement(0)
    dst, dst_sbp = placement(len(src.ranks) + draw(st.integers(0, 3)))
    return shape, src, src_sbp, dst, dst_sbp


@settings(max_examples=100, deadline=None)
@given(case=transfers(), seed=st.integers(0, 2**16))
def test_random_placements(case, seed):
    shape, src, src_sbp, dst, dst_sbp = case
    assert not set(src.ranks) & set(dst.ranks)
    _check_transfer(shape, src, src_sbp, dst, dst_sbp)
    _move(shape, src, src_sbp, dst, dst_sbp, seed)


def _scanned(shape, src, src_sbp, dst, dst_sbp, rank, send: bool) -> list[Piece]:
    """The pieces by their definition, every rank of the other placement scanned."""
    from meshplan.ir.pieces import _replicas
    out = []
    if send:
        coord = src.coord(rank)
        reps = _replicas(src, src_sbp, coord)
        for index, d in enumerate(dst.ranks):
            part = intersect(_box_of(src, src_sbp, shape, rank), _box_of(dst, dst_sbp, shape, d))
            if reps[index % len(reps)] == rank and part is not None:
                out.append(Piece(rank, d, part))
        return out
    index = dst.ranks.index(rank)
    ranges = [range(n) if isinstance(s, Shard) else range(1) for n, s in zip(src.grid, src_sbp)]
    for c in itertools.product(*ranges):
        part = intersect(_box_of(dst, dst_sbp, shape, rank),
                         local_box(shape, src_sbp, src.grid, c))
        if part is not None:
            reps = _replicas(src, src_sbp, c)
            out.append(Piece(reps[index % len(reps)], rank, part))
    return out


@settings(max_examples=150, deadline=None)
@given(case=transfers())
def test_pieces_equal_the_whole_placement_scan(case):
    """The pruned walk (parts meeting the rank's box, by bisection) finds
    exactly what scanning every rank of the other placement finds, in order."""
    shape, src, src_sbp, dst, dst_sbp = case
    for r in src.ranks:
        assert send_pieces(shape, src, src_sbp, dst, dst_sbp, r) == \
            _scanned(shape, src, src_sbp, dst, dst_sbp, r, send=True)
    for r in dst.ranks:
        assert recv_pieces(shape, src, src_sbp, dst, dst_sbp, r) == \
            _scanned(shape, src, src_sbp, dst, dst_sbp, r, send=False)


# -- replicas and Partial ---------------------------------------------------------------


def test_replicas_spread_load():
    # Source: grid (2, 2), S(0) on axis 0, R on axis 1 -> ranks (0, 1) and (2, 3) are replicas.
    src = Placement((0, 1, 2, 3), (2, 2))
    dst = Placement((4, 5, 6, 7), (4,))
    shape = (8, 3)
    pieces = _check_transfer(shape, src, (Shard(0), R), dst, (R,))
    _move(shape, src, (Shard(0), R), dst, (R,), seed=0)
    load = Counter(p.src for p in pieces)
    assert load == {0: 2, 1: 2, 2: 2, 3: 2}
    for group in [(0, 1), (2, 3)]:
        served = [{p.dst for p in pieces if p.src == s} for s in group]
        assert not served[0] & served[1]
        assert served[0] | served[1] == set(dst.ranks)


@pytest.mark.parametrize("sbp", [(Partial(),), (Partial("max"),)])
def test_partial_source_rejected(sbp):
    src = Placement((0, 1), (2,))
    dst = Placement((2, 3), (2,))
    with pytest.raises(AssertionError):
        recv_pieces((4,), src, sbp, dst, (Shard(0),), 2)
    with pytest.raises(AssertionError):
        send_pieces((4,), src, sbp, dst, (Shard(0),), 0)


def test_partial_on_one_axis_rejected():
    src = Placement((0, 1, 2, 3), (2, 2))
    dst = Placement((4, 5), (2,))
    for rank in dst.ranks:
        with pytest.raises(AssertionError):
            recv_pieces((4, 4), src, (Shard(0), Partial()), dst, (R,), rank)
    for rank in itertools.islice(src.ranks, 2):
        with pytest.raises(AssertionError):
            send_pieces((4, 4), src, (Shard(0), Partial()), dst, (R,), rank)
