"""Packed pairs (`--pack`, `data/pairs.py`): next-fit rows that hold every
pair of an epoch once, in the seeded order, each pair laid out as a joined
row is, its position ids from 0; any row read alone, at any layout or after
a resume, is the row read in sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.data.feed import FeedReader, Layout, TokenFeed
from meshplan.data.masking import IGNORE_INDEX
from meshplan.data.pairs import PackedPairReader, PairReader, joined, pack_rows, packed
from meshplan.data.prepare import prepare_data
from meshplan.data.tokens import TokenData
from tests.token_data import pairs_jsonl

EOD = 256


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("packed")
    pairs_jsonl(tmp / "pairs.jsonl", 80)
    prepare_data([str(tmp / "pairs.jsonl")], str(tmp / "data"), val_fraction=0.2,
                 target_field="target")
    return str(tmp / "data")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=60), st.integers(4, 48))
def test_next_fit_rows_cover_the_pairs_in_order_and_are_full(lengths, budget):
    starts = pack_rows(np.array(lengths), budget).tolist()
    assert starts[0] == 0 and starts[-1] == len(lengths)
    clipped = [min(n, budget) for n in lengths]
    for lo, hi in zip(starts, starts[1:]):
        assert hi > lo and sum(clipped[lo:hi]) <= budget
        if hi < len(lengths):  # the next pair did not fit: the row is as full as next-fit makes it
            assert sum(clipped[lo:hi + 1]) > budget


def test_a_packed_row_lays_out_each_pair_as_a_joined_row_does():
    a = (np.array([1, 2, EOD]), np.array([3, 4, EOD]))
    b = (np.array([5, EOD]), np.array([6, 7, 8, EOD]))
    x, y, pos = packed([[a, b], [b]], 16, EOD)
    assert x[0, :12].tolist() == [1, 2, EOD, 3, 4, EOD, 5, EOD, 6, 7, 8, EOD]
    assert y[0, :12].tolist() == [IGNORE_INDEX] * 3 + [3, 4, EOD] + [IGNORE_INDEX] * 2 + \
        [6, 7, 8, EOD]
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert (x[0, 12:] == EOD).all() and (y[0, 12:] == IGNORE_INDEX).all()
    # each pair, cut out at its positions, is its joined row's start; the
    # zoo's labels (the next tokens) too, never the next pair's first token
    nx, ny, npos = packed([[a, b], [b]], 16, EOD, shifted=False)
    assert torch.equal(nx, x) and torch.equal(npos, pos)
    assert ny[0, :12].tolist() == [IGNORE_INDEX] * 2 + [3, 4, EOD] + [IGNORE_INDEX] * 2 + \
        [6, 7, 8, EOD, IGNORE_INDEX]
    for row, (lo, hi), p in ((0, (0, 6), a), (0, (6, 12), b), (1, (0, 6), b)):
        for shifted, labels in ((True, y), (False, ny)):
            jx, jy = joined([p], 16, EOD, shifted=shifted)
            assert torch.equal(x[row, lo:hi], jx[0, :hi - lo])
            assert torch.equal(labels[row, lo:hi], jy[0, :hi - lo])


def test_a_pair_longer_than_the_row_is_cut_as_a_joined_row_is():
    long = (np.array([9] * 30 + [EOD]), np.array([8] * 30 + [EOD]))
    x, y, pos = packed([[long]], 16, EOD)
    jx, jy = joined([long], 16, EOD, shifted=True)
    assert torch.equal(x[0], jx[0]) and torch.equal(y[0], jy[0])
    assert pos[0].tolist() == list(range(16))


def test_an_epoch_packs_every_pair_once_in_the_seeded_order(data):
    d = TokenData(data, "train")
    reader = PackedPairReader(d, 64, 7)
    rows = reader.rows_in_epoch(0)
    got = reader.read(np.arange(rows))
    ids = np.concatenate([PairReader(d, 64, 7).sample_ids(np.arange(d.documents))])
    flat = [(s.tolist(), t.tolist()) for row in got for s, t in row]
    want = [(s.tolist(), t.tolist()) for s, t in PairReader(d, 64, 7, shuffle=False).read(ids)]
    assert flat == want
    assert rows < d.documents  # several pairs share a row
    # the next epoch is another order of the same pairs, packed by their own lengths
    second = reader.read(np.arange(rows, rows + reader.rows_in_epoch(1)))
    again = [(s.tolist(), t.tolist()) for row in second for s, t in row]
    assert sorted(again) == sorted(want) and again != want
    for epoch in (got, second):
        sizes = [[min(len(s) + len(t), 64) for s, t in row] for row in epoch]
        for row, after in zip(sizes, sizes[1:] + [[]]):
            assert sum(row) <= 64 and (not after or sum(row) + after[0] > 64)


def test_a_row_read_alone_is_the_row_read_in_sequence(data):
    """Row r is a pure function of (seed, r): a fresh reader (a resumed run,
    another rank) reading a row two epochs on sees what one reading every
    row before it does."""
    d = TokenData(data, "train")
    seq = PackedPairReader(d, 64, 3)
    n = seq.rows_in_epoch(0) + seq.rows_in_epoch(1) + 2
    every = seq.read(np.arange(n + 1))
    alone = PackedPairReader(TokenData(data, "train"), 64, 3).read([n])
    assert [(s.tolist(), t.tolist()) for s, t in alone[0]] == \
        [(s.tolist(), t.tolist()) for s, t in every[n]]


def test_any_rows_of_any_micro_batch_read_as_the_whole_batch(data):
    feed = TokenFeed(data, "train", 64, 5, Layout.PACKED_SHIFTED)
    whole = FeedReader(feed, 8, 2)
    for step in range(4):
        parts = whole.microbatches(step)
        for lo, hi in ((0, 2), (2, 4), (1, 3)):
            mine = FeedReader(feed, 8, 2).microbatches(step, (lo, hi))
            for full, part in zip(parts, mine):
                assert len(full) == len(part) == 3
                assert all(torch.equal(f[lo:hi], p) for f, p in zip(full, part))
    x, y, pos = whole.batch(1)
    assert x.shape == y.shape == pos.shape == (8, 64)
