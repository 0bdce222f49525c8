"""Uneven stages by cost (`passes/balance.py`): exact against brute force,
even where the weights are, and the layouts the pipeline pass accepts."""

import itertools
import random

import pytest

from meshplan.errors import ConfigError
from meshplan.passes.balance import balance


def brute(weights, k):
    """The least heaviest segment over every cut into k non-empty segments."""
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def heaviest(weights, counts):
    out, i = [], 0
    for c in counts:
        out.append(sum(weights[i:i + c]))
        i += c
    return max(out)


@pytest.mark.parametrize("seed", range(40))
def test_balance_is_exact(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    weights = [rng.choice([1.0, 2.0, 3.5, rng.uniform(0.1, 5)]) for _ in range(n)]
    counts = balance(weights, k)
    assert len(counts) == k and sum(counts) == n and min(counts) >= 1
    assert heaviest(weights, counts) == pytest.approx(brute(weights, k), rel=1e-9)


def test_equal_weights_split_evenly():
    assert balance([1.0] * 96, 16) == (6,) * 16
    assert balance([2.0] * 8, 4) == (2, 2, 2, 2)


def test_heavy_ends_get_fewer_layers():
    # the embedding on the first layer and head + loss on the last (GPT-3's ratio)
    weights = [1.0] * 96
    weights[0] += 0.4
    weights[-1] += 1.3
    counts = balance(weights, 16)
    assert counts[-1] < 6 and sum(counts) == 96
    assert heaviest(weights, counts) < heaviest(weights, (6,) * 16)


def test_more_segments_than_layers_is_a_user_error():
    with pytest.raises(ConfigError, match="lower pp or vpp"):
        balance([1.0, 1.0], 3)
