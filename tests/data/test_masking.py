"""Masked-token noise (`data/masking.py`) as a feed reads it: BERT's recipe
and the denoising pair, drawn per global position, so any rows of any
micro-batch mask as the whole batch does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshplan.data.feed import FeedReader, Layout, TokenFeed
from meshplan.data.masking import IGNORE_INDEX
from tests.token_data import prepare, stdlib_sources

MASK = 257  # one past the byte tokenizer's 257 ids (bytes and eod 256)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("masking") / "data", stdlib_sources(4)[1:],
                   "--val-fraction", "0.2")


def feed(data: str, layout: Layout, **kw) -> TokenFeed:
    return TokenFeed(data, "train", 64, 3, layout, mask_id=MASK, **kw)


def unmasked(data: str, steps: int, gbs: int) -> torch.Tensor:
    """The samples themselves: the shifted-by-model layout's inputs."""
    r = FeedReader(feed(data, Layout.SHIFTED_BY_MODEL), gbs, 1)
    return torch.cat([r.batch(k)[0] for k in range(steps)])


@pytest.mark.parametrize("layout", [Layout.MASKED, Layout.DENOISE])
def test_any_rows_of_any_micro_batch_mask_as_the_whole_batch(data, layout):
    """dp2 (each rank half of each micro-batch) and 4 micro-batches read the
    very inputs and labels the eager reference's whole batches hold."""
    whole = FeedReader(feed(data, layout), 16, 1)
    parts = FeedReader(feed(data, layout), 16, 4)
    for step in range(3):
        x, y = whole.batch(step)
        halves = [parts.microbatches(step, rows) for rows in ((0, 2), (2, 4))]
        for i in range(4):
            got = [torch.cat([h[i][k] for h in halves]) for k in range(2)]
            assert torch.equal(got[0], x[4 * i:4 * i + 4])
            assert torch.equal(got[1], y[4 * i:4 * i + 4])


def test_berts_recipe(data):
    """15% of the positions are chosen, never the separator; labels are the
    originals there and -100 elsewhere; of the chosen, 80% read the mask id,
    10% another token and 10% themselves; each row has a label; the next
    epoch's draw of a sample differs."""
    steps, gbs = 40, 16
    x = unmasked(data, steps, gbs)
    r = FeedReader(feed(data, Layout.MASKED), gbs, 1)
    inputs, labels = (torch.cat(t) for t in zip(*(r.batch(k) for k in range(steps))))
    chosen = labels != IGNORE_INDEX
    assert torch.equal(labels[chosen], x[chosen])
    assert not chosen[x == 256].any()
    assert chosen.any(1).all()
    assert abs(chosen.float().mean().item() - 0.15) < 0.01
    n = chosen.sum().item()
    masked = (inputs[chosen] == MASK).sum().item() / n
    kept = (inputs[chosen] == x[chosen]).sum().item() / n
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1) < 0.02
    assert torch.equal(inputs[~chosen], x[~chosen])
    assert (inputs[chosen] < 257).sum().item() / n == pytest.approx(0.2, abs=0.02)


def test_denoising_masks_the_chosen_and_labels_the_whole(data):
    x = unmasked(data, 10, 16)
    r = FeedReader(feed(data, Layout.DENOISE, mask_rate=0.3), 16, 1)
    inputs, labels = (torch.cat(t) for t in zip(*(r.batch(k) for k in range(10))))
    assert torch.equal(labels, x)
    chosen = inputs == MASK
    assert torch.equal(inputs[~chosen], x[~chosen])
    assert abs(chosen.float().mean().item() - 0.3) < 0.02
    assert not chosen[x == 256].any() and chosen.any(1).all()


def test_a_sample_read_again_is_masked_anew(data):
    """Dynamic masking: the same sample at two positions (two epochs) draws
    two masks; the same position draws the same mask twice."""
    r = FeedReader(feed(data, Layout.MASKED), 1, 1)
    n = r.reader.num_samples
    first, again = r.microbatches(0)[0], r.microbatches(0)[0]
    assert torch.equal(first[1], again[1])
    ids = r.reader.sample_ids(np.arange(2 * n))
    k = int(np.flatnonzero(ids[n:] == ids[0])[0]) + n  # sample 0's position next epoch
    later = r.microbatches(k)[0]
    assert torch.equal(torch.where(later[1] < 0, later[0], later[1]),
                       torch.where(first[1] < 0, first[0], first[1]))  # the same sample
    assert not torch.equal(later[1], first[1])


@pytest.mark.parametrize("layout", [Layout.MASKED, Layout.DENOISE])
def test_a_row_the_draw_left_unmasked_gets_one_masked_token(data, layout):
    """seq 8 at rate 0.02: most rows draw nothing, and one position is
    chosen for them, so no micro-batch's mean loss is over nothing."""
    r = FeedReader(TokenFeed(data, "train", 8, 3, layout, mask_id=MASK, mask_rate=0.02), 64, 1)
    inputs, labels = r.batch(0)
    chosen = inputs == MASK if layout is Layout.DENOISE else labels != IGNORE_INDEX
    per_row = chosen.sum(1)
    assert (per_row >= 1).all() and (per_row == 1).float().mean() > 0.8
