"""Boxing's conversion order (`passes/boxing.conversion_steps`): every step
is one the runtime can run from the boxes alone, even where shards of one
dim nest over several axes (a batch split over dp and ep)."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.ir.sbp import Partial, Replicate, Shard, intersect, local_box
from meshplan.passes.boxing import conversion_steps

R, P = Replicate(), Partial()


def _line(grid, coord, axis):
    return [coord[:axis] + (k,) + coord[axis + 1:] for k in range(grid[axis])]


def legal(shape, grid, cur, axis, dst) -> bool:
    """Whether one step on `axis` (cur[axis] -> dst) gives every coordinate
    its new box as the runtime makes it: a reduction or a slice narrows the
    rank's own box; a gather concatenates its line's boxes; an all-to-all
    joins its line's parts of the new box along the old shard dim."""
    nxt = tuple(dst if a == axis else s for a, s in enumerate(cur))
    src = cur[axis]
    for coord in itertools.product(*(range(n) for n in grid)):
        have = local_box(shape, cur, grid, coord)
        want = local_box(shape, nxt, grid, coord)
        if not isinstance(src, Shard):  # P -> R/S, R -> S: narrow the own box
            if intersect(have, want) != want and all(b > a for a, b in want):
                return False
            continue
        boxes = [local_box(shape, cur, grid, c) for c in _line(grid, coord, axis)]
        parts = boxes if isinstance(dst, Replicate) else \
            [intersect(b, want) for b in boxes]
        parts = [p for p in parts if p is not None and all(b > a for a, b in p)]
        d, lo = src.dim, want[src.dim][0]
        for p in parts:
            if p[:d] + p[d + 1:] != want[:d] + want[d + 1:] or p[d][0] != lo:
                return False
            lo = p[d][1]
        if lo != want[d][1] and all(b > a for a, b in want):
            return False
    return True


def test_the_checker_fails_the_old_order():
    """Gathering the outer axis of a batch split over two axes first (the
    order before ep: Partial axes, then axis by axis) mixes up the parts."""
    shape, grid = (8, 3), (2, 2)
    assert not legal(shape, grid, (Shard(0), Shard(0)), 0, R)
    assert legal(shape, grid, (Shard(0), Shard(0)), 1, R)
    assert conversion_steps((Shard(0), Shard(0)), (R, R)) == [(1, R), (0, R)]


layouts = st.sampled_from([R, P, Shard(0), Shard(1)])


@settings(max_examples=300, deadline=None)
@given(grid=st.lists(st.integers(1, 3), min_size=2, max_size=3),
       shape=st.tuples(st.integers(1, 7), st.integers(1, 7)), data=st.data())
def test_every_step_is_one_the_runtime_can_run(grid, shape, data):
    grid = tuple(grid)
    have = tuple(data.draw(layouts) for _ in grid)
    need = tuple(data.draw(st.sampled_from([R, Shard(0), Shard(1)])) for _ in grid)
    cur = have
    for axis, dst in conversion_steps(have, need):
        assert not isinstance(dst, Partial)
        assert legal(shape, grid, cur, axis, dst), (have, need, cur, axis, dst)
        cur = tuple(dst if a == axis else s for a, s in enumerate(cur))
    assert cur == need


def test_a_whole_value_becomes_its_share_of_a_sum_locally():
    """R -> P(sum): a gradient accumulator laid out Partial takes a whole
    contribution (ELECTRA's tied embedding at tp2·pp2 crashed planning here,
    `cannot make P from R`). The axis's first rank keeps it, the others hold
    zeros: their sum is the value, exactly."""
    from types import SimpleNamespace

    from meshplan.ir.kinds import LOCAL_PARTIAL
    from meshplan.passes.boxing import _step
    from meshplan.runtime.bind import _share_of_sum

    assert conversion_steps((R, R), (R, P)) == [(1, P)]
    assert _step(R, P) == (LOCAL_PARTIAL, {})
    x = torch.randn(3, 5)
    shares = [_share_of_sum(SimpleNamespace(coord=(0, k)), 1)(x) for k in range(3)]
    assert torch.equal(sum(shares), x) and torch.equal(shares[0], x)


def test_a_shard_becomes_a_share_of_a_sum_through_the_whole_value():
    """S(d) -> P(sum): a gradient accumulator laid out Partial takes a split
    contribution (a cumsum's vjp taking its splits, tests/passes/test_shared.py's
    ReadTwice at tp2·pp2 crashed planning: `cannot make P from S(1)`). It is
    gathered, then made the share; other axes are left alone."""
    assert conversion_steps((R, Shard(1)), (R, P)) == [(1, R), (1, P)]
    assert conversion_steps((Shard(0), Shard(1)), (Shard(0), P)) == [(1, R), (1, P)]
