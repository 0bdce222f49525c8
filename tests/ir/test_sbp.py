"""SBP slices: near-equal splits, nested N-D boxes, string forms, grid coordinates."""

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.ir.mesh import Placement
from meshplan.ir.sbp import (
    Partial,
    R,
    Replicate,
    Shard,
    box_numel,
    fmt,
    intersect,
    local_box,
    local_shape,
    split_range,
)

# -- split_range -------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(size=st.integers(0, 200), parts=st.integers(1, 20))
def test_split_range_matches_tensor_split(size, parts):
    ranges = [split_range(size, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == size
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        assert stop == start
    lengths = [b - a for a, b in ranges]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # longer parts first
    assert lengths == [len(t) for t in torch.arange(size).tensor_split(parts)]


def test_split_range_examples():
    assert [split_range(7, 3, i) for i in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [split_range(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert split_range(0, 1, 0) == (0, 0)


# -- local_box ---------------------------------------------------------------------


@st.composite
def sharded_tensors(draw):
    """(shape, grid, sbp): Shard dims valid, several axes may shard one dim."""
    shape = tuple(draw(st.lists(st.integers(1, 13), min_size=1, max_size=4)))
    grid = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    kinds = st.one_of(
        st.builds(Shard, st.integers(0, len(shape) - 1)),
        st.just(R),
        st.just(Partial()),
    )
    sbp = tuple(draw(kinds) for _ in grid)
    return shape, grid, sbp


def _coords(grid):
    return list(itertools.product(*(range(n) for n in grid)))


def _torch_box(shape, sbp, grid, coord):
    """The box at `coord` by tensor_split of the running slice, outer axis first."""
    box = [(0, n) for n in shape]
    for axis, s in enumerate(sbp):
        if isinstance(s, Shard):
            lo, hi = box[s.dim]
            parts = torch.arange(lo, hi).tensor_split(grid[axis])
            start = lo + sum(len(t) for t in parts[: coord[axis]])
            part = parts[coord[axis]]
            assert torch.equal(part, torch.arange(start, start + len(part)))
            box[s.dim] = (start, start + len(part))
    return tuple(box)


@settings(max_examples=100, deadline=None)
@given(sharded_tensors())
def test_local_box_tiles_tensor(case):
    shape, grid, sbp = case
    counter = torch.zeros(shape, dtype=torch.int64)
    for coord in _coords(grid):
        box = local_box(shape, sbp, grid, coord)
        # (a) within the shape
        assert len(box) == len(shape)
        for (a, b), n in zip(box, shape):
            assert 0 <= a <= b <= n
        assert local_shape(shape, sbp, grid, coord) == tuple(b - a for a, b in box)
        counter[tuple(slice(a, b) for a, b in box)] += 1
        # (c) nesting order: outer axis splits first, matching tensor_split
        assert box == _torch_box(shape, sbp, grid, coord)
    # (b) every element covered once per replica
    replicas = math.prod(n for n, s in zip(grid, sbp) if not isinstance(s, Shard))
    assert torch.all(counter == replicas)


def test_local_box_nested_order():
    # S(0) on both axes of a (2, 3) grid: axis 0 halves, axis 1 splits each half in 3.
    shape, sbp, grid = (12, 5), (Shard(0), Shard(0)), (2, 3)
    assert local_box(shape, sbp, grid, (0, 0)) == ((0, 2), (0, 5))
    assert local_box(shape, sbp, grid, (1, 0)) == ((6, 8), (0, 5))
    assert local_box(shape, sbp, grid, (1, 2)) == ((10, 12), (0, 5))
    assert local_box((12, 5), (R, Shard(1)), (2, 2), (1, 1)) == ((0, 12), (3, 5))


# -- boxes and string forms ----------------------------------------------------------


def test_intersect_and_numel():
    a = ((0, 4), (2, 6))
    b = ((2, 8), (0, 3))
    assert intersect(a, b) == ((2, 4), (2, 3))
    assert intersect(b, a) == intersect(a, b)
    assert intersect(a, a) == a
    assert intersect(a, ((4, 6), (0, 6))) is None  # touching is not overlapping
    assert intersect(a, ((0, 4), (6, 9))) is None
    assert intersect((), ()) == ()
    assert box_numel(a) == 16
    assert box_numel(((0, 4), (2, 2))) == 0
    assert box_numel(()) == 1


def test_string_forms():
    assert fmt((Shard(0), R)) == "S(0)R"
    assert fmt((Partial(), Shard(2))) == "PS(2)"
    assert fmt(()) == ""
    assert str(Partial("max")) == "P(max)"
    assert str(Partial()) == "P"
    assert str(Replicate()) == "R"
    assert Replicate() == R


# -- Placement coordinates -----------------------------------------------------------


@st.composite
def placements(draw):
    grid = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    n = math.prod(grid)
    first = draw(st.integers(0, 100))
    ranks = draw(st.permutations(range(first, first + n)))
    return Placement(tuple(ranks), grid)


@settings(max_examples=100, deadline=None)
@given(placements())
def test_coord_rank_at_round_trip(place):
    seen = set()
    for i, rank in enumerate(place.ranks):
        coord = place.coord(rank)
        assert len(coord) == len(place.grid)
        assert all(0 <= c < n for c, n in zip(coord, place.grid))
        assert place.rank_at(coord) == rank
        # row-major, outermost axis first
        flat = 0
        for c, n in zip(coord, place.grid):
            flat = flat * n + c
        assert flat == i
        seen.add(coord)
    assert len(seen) == len(place.ranks)
    for coord in _coords(place.grid):
        assert place.coord(place.rank_at(coord)) == coord


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_distinct_local_shapes_are_those_of_every_coordinate(data):
    """The sampled cuts (index 0 and each remainder) find exactly the local
    shapes some grid coordinate has, all tensors together."""

    from meshplan.ir.sbp import distinct_local_shapes, local_shape

    grid = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    tensors = []
    for _ in range(data.draw(st.integers(1, 3))):
        shape = tuple(data.draw(st.lists(st.integers(1, 11), min_size=1, max_size=3)))
        sbp = tuple(data.draw(st.one_of(st.just(R), st.builds(Shard, st.integers(
            0, len(shape) - 1)))) for _ in grid)
        tensors.append((shape, sbp))
    every = {tuple(local_shape(sh, sbp, grid, c) for sh, sbp in tensors)
             for c in itertools.product(*(range(n) for n in grid))}
    assert distinct_local_shapes(tensors, grid) == every
