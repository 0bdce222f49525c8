"""ops/counter_rng.py: a box of a logical draw is that box of the whole draw,
every element is the documented hash of its index, and the draws have the
distribution they claim."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.ops import counter_rng as rng


def _element(index: int, key: tuple[int, int], offset: int = 0) -> int:
    """The generator's word for one index, in Python ints (the docstring's formula)."""
    index += offset
    lo, hi = index & rng.M32, index >> 32
    return rng.mix(rng.mix(lo ^ key[0]) ^ rng.mix(hi ^ key[1]))


@st.composite
def _boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    box = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        box.append((a, draw(st.integers(a + 1, n))))
    return shape, tuple(box), draw(st.integers(1, 64))


@settings(max_examples=60, deadline=None)
@given(_boxes(), st.integers(0, 2**40))
def test_a_box_is_the_whole_draw_sliced(case, seed):
    shape, box, chunk = case
    key = rng.Stream(rng.key_words(seed, 3, 7), seed % 1000)
    whole = rng.bits(rng.whole(shape), shape, key)
    old, rng.CHUNK = rng.CHUNK, chunk  # chunked or not, the same words
    try:
        part = rng.bits(box, shape, key)
    finally:
        rng.CHUNK = old
    assert torch.equal(part, whole[tuple(slice(a, b) for a, b in box)])


def test_every_word_is_the_hash_of_its_index():
    key = rng.key_words(5, 0, 11)
    shape = (3, 7)
    words = rng.bits(rng.whole(shape), shape, rng.Stream(key, 42)).flatten().tolist()
    assert words == [_element(i, key, 42) for i in range(21)]
    x = torch.tensor([0, 1, 12345, rng.M32])
    assert rng._mix_(x.clone(), torch.empty_like(x)).tolist() == [rng.mix(int(v)) for v in x]


def test_an_index_past_two_to_the_32_uses_its_high_word():
    """A logical tensor of more than 2^32 elements: a box at its end is drawn
    (not the whole), and the high word of the index changes the bits."""
    shape = (1 << 21, 1 << 12)  # 2^33 elements, never allocated
    key = rng.key_words(1, 2, 3, 4)
    box = ((shape[0] - 2, shape[0]), (shape[1] - 3, shape[1]))
    got = rng.bits(box, shape, rng.Stream(key)).flatten().tolist()
    want = [_element(r * shape[1] + c, key) for r in range(*box[0]) for c in range(*box[1])]
    assert got == want
    assert want[0] != _element((shape[0] - 2) * shape[1] + shape[1] - 3 & rng.M32, key)


def test_micro_batches_lie_end_to_end():
    """Micro-batch m's draw continues where m - 1's ends: two micro-batches of
    2 rows draw what one of 4 rows does."""
    counter, shape = rng.RandomCounter(7, 3), (2, 5)
    parts = []
    for m in range(2):
        counter.microbatch = m
        parts.append(rng.bits(rng.whole(shape), shape, counter.stream(4, shape)))
    counter.microbatch = 0
    one = rng.bits(rng.whole((4, 5)), (4, 5), counter.stream(4, (4, 5)))
    assert torch.equal(torch.cat(parts), one)


def test_keys_are_distinct_and_order_sensitive():
    keys = {rng.key_words(0, s, k) for s in range(64) for k in range(32)}
    assert len(keys) == 64 * 32
    assert rng.key_words(0, 1, 2) != rng.key_words(0, 2, 1)
    with pytest.raises(AssertionError):
        rng.key_words(-1)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_and_uniform_and_normal_moments(p):
    n = 1 << 20
    key = rng.Stream(rng.key_words(9, 0, 0))
    kept = rng.keep_mask(rng.whole((n,)), (n,), p, key).double().mean().item()
    assert abs(kept - (1 - p)) < 3 * math.sqrt(p * (1 - p) / n)
    u = rng.uniform(rng.whole((n,)), (n,), key, torch.float64)
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 3 * math.sqrt(1 / 12 / n)
    z = rng.normal(rng.whole((n,)), (n,), key, torch.float64)
    assert abs(z.mean().item()) < 3 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 3 * math.sqrt(2 / n)
    i = rng.integers(rng.whole((n,)), (n,), key, 3, 10, torch.int64)
    assert i.min() == 3 and i.max() == 9


def test_neighbouring_elements_and_keys_are_uncorrelated():
    n = 1 << 18
    a = rng.uniform(rng.whole((n,)), (n,), rng.Stream(rng.key_words(0, 0, 0)), torch.float64)
    b = rng.uniform(rng.whole((n,)), (n,), rng.Stream(rng.key_words(0, 0, 1)), torch.float64)
    bound = 4 / math.sqrt(n)
    assert abs(torch.corrcoef(torch.stack([a[1:], a[:-1]]))[0, 1]) < bound
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < bound
