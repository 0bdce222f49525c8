"""Samples and their order: exact contents on a hand-written directory, the
Feistel order a permutation per epoch (property tests), epoch boundaries,
and the reader's row count."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.data.sampler import SampleReader, num_samples, permute, sample_ids
from meshplan.data.tokens import TokenData
from meshplan.errors import ConfigError
from tests.data.test_tokens import write_dir

TOKENS = [10, 11, 12, 13, 256, 20, 21, 22, 23, 24, 256]  # 11 tokens; longest document 6


@pytest.fixture
def data(tmp_path):
    return TokenData(write_dir(tmp_path / "d", TOKENS, [1, 256]))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**63), epoch=st.integers(0, 10**6))
def test_each_epoch_is_a_permutation_and_deterministic(n, seed, epoch):
    order = permute(np.arange(n), n, seed, epoch)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == list(range(n))
    assert (permute(np.arange(n), n, seed, epoch) == order).all()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(10, 5000), seed=st.integers(0, 2**32))
def test_different_seeds_and_epochs_give_different_orders(n, seed):
    order = permute(np.arange(n), n, seed, 0)
    assert (permute(np.arange(n), n, seed + 1, 0) != order).any()
    assert (permute(np.arange(n), n, seed, 1) != order).any()


def test_a_subset_of_positions_maps_as_in_the_whole():
    whole = permute(np.arange(1000), 1000, 3, 0)
    pick = np.array([999, 0, 500, 17])
    assert (permute(pick, 1000, 3, 0) == whole[pick]).all()


def test_positions_span_an_epoch_boundary():
    n = 7
    p = np.arange(5, 10)  # 5, 6 of epoch 0; 0, 1, 2 of epoch 1
    ids = sample_ids(p, n, seed=4)
    assert ids[:2].tolist() == permute(np.array([5, 6]), n, 4, 0).tolist()
    assert ids[2:].tolist() == permute(np.array([0, 1, 2]), n, 4, 1).tolist()
    assert sample_ids(p, n, seed=4, shuffle=False).tolist() == [5, 6, 0, 1, 2]
    with pytest.raises(ConfigError, match=">= 0"):
        sample_ids([-1], n, seed=4)


def test_samples_are_exact_slices(data):
    assert num_samples(len(TOKENS), 3) == 3
    r = SampleReader(data, seq_len=3, seed=0, shuffle=False)
    out = r.read([0, 1, 2, 3, 5])
    assert out.dtype == torch.int64 and out.shape == (5, 4)
    assert out.tolist() == [[10, 11, 12, 13], [13, 256, 20, 21], [21, 22, 23, 24],
                            [10, 11, 12, 13], [21, 22, 23, 24]]  # 3 -> 0, 5 -> 2: epoch 1


def test_shuffled_reads_follow_sample_ids_and_count_rows(data):
    r = SampleReader(data, seq_len=2, seed=9)
    assert r.num_samples == 5 and r.rows_read == 0
    positions = np.arange(12)
    out = r.read(positions)
    for row, i in zip(out.tolist(), r.sample_ids(positions).tolist()):
        assert row == TOKENS[2 * i: 2 * i + 3]
    assert sorted(r.sample_ids(np.arange(5)).tolist()) == [0, 1, 2, 3, 4]
    r.read([3])
    assert r.rows_read == 13


def test_a_reader_checks_seq_len(data):
    with pytest.raises(ConfigError, match="longer than every document"):
        SampleReader(data, seq_len=6, seed=0)


def test_the_order_needs_no_memory_of_size_n():
    n = 10**12  # a materialized permutation would need 8 TB
    out = permute(np.array([0, 5, n - 1]), n, 1, 2)
    assert ((out >= 0) & (out < n)).all() and len(set(out.tolist())) == 3
