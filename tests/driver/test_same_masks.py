"""verify's twin reference (`verify.reordered`: each micro-batch's samples
in reverse order) draws its random numbers in its samples' order, so that
the twin is the same mathematics with other rounding (`same_masks.py`)."""

from __future__ import annotations

import pytest
import torch

from meshplan.driver.same_masks import SameMasks


def draw(shape, flip=0):
    with SameMasks(0, flip).at(0, 0):
        return torch.rand(shape)


@pytest.mark.parametrize("shape, blocks", [((4, 3), 1), ((20, 3), 5), ((8,), 2)])
def test_a_draw_over_the_samples_or_their_tokens_follows_its_samples(shape, blocks):
    """(4, 3): a mask per sample; (20, 3): a routing draw over 4 samples' 5
    tokens each, flattened sample-major (PhiMoE's): its blocks reverse."""
    plain, twin = draw(shape), draw(shape, flip=4)
    assert torch.equal(twin.unflatten(0, (4, blocks)), plain.unflatten(0, (4, blocks)).flip(0))


@pytest.mark.parametrize("shape", [(6, 3), (3, 4)])
def test_a_draw_not_over_the_samples_is_the_references(shape):
    assert torch.equal(draw(shape), draw(shape, flip=4))
