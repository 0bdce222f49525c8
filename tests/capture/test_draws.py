"""The in-place draws (`uniform_`, `exponential_`, `normal_`, `bernoulli_`:
an MoE router's jitter, PhiMoE's sparse mixer) are layout-invariant
random ops like dropout; any other draw from torch's generator is refused
at capture, since its numbers would differ by rank and layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshplan.api as mp
from meshplan.driver import same_masks
from meshplan.errors import CaptureError
from meshplan.ir.kinds import RANDOM_LIKE
from meshplan.ops import counter_rng as rng
from meshplan.ops import random_ops
from meshplan.ops.resolve import resolve_op


class Jitter(nn.Module):
    """Every in-place draw, each scaling the hidden layer."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.fc1(x)
        noise = (torch.empty_like(h).uniform_(0.5, 1.5) * torch.empty_like(h).exponential_(2.0)
                 + torch.empty_like(h).normal_(1.0, 0.1) * torch.empty_like(h).bernoulli_(0.7)
                 + torch.rand_like(h).uniform_())
        return nn.functional.mse_loss(self.fc2(torch.tanh(h * noise)), y)


def _data(steps: int, size: int):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 8, generator=g))
            for _ in range(steps)]


def _verify(dp: int, plant=None):
    """verify a dp-rank run of `Jitter`; `plant()` called after capture
    (whose self-check would see it first)."""
    torch.manual_seed(0)
    module, data = Jitter(), _data(2, 8)
    graph = mp.capture(module, tuple(t[:4] for t in data[0]))
    assert sum(op.kind == RANDOM_LIKE for op in graph.ops) == 6
    if plant is not None:
        plant()
    strategy = mp.Strategy(dp=dp, global_batch_size=8, micro_batch_size=4 // dp)
    job = mp.plan(graph, mp.Mesh(1, dp), strategy)
    return mp.verify(job, module, data, timeout_s=60)


@pytest.mark.parametrize("dp", [1, 2])
def test_in_place_draws_train_as_eager_drawing_the_same_numbers(dp):
    result = _verify(dp)
    assert result.ok and result.max_abs_diff <= 1e-6, result.problems


def test_eager_drawing_torchs_numbers_for_one_of_them_is_caught(monkeypatch):
    """Planted: the reference draws `exponential_` from torch's generator
    (the capture self-check, run first, would refuse it too)."""
    result = _verify(1, lambda: monkeypatch.delitem(same_masks._HANDLERS,
                                                    torch.Tensor.exponential_))
    assert not result.ok


@pytest.mark.parametrize("dist, params, mean, std", [
    ("uniform", (-2.0, 3.0), 0.5, 5 / 12 ** 0.5),
    ("exponential", (2.0,), 0.5, 0.5),
    ("normal", (1.0, 0.5), 1.0, 0.5),
])
def test_each_distribution_has_its_mean_and_deviation(dist, params, mean, std):
    shape = (200_000,)
    stream = rng.RandomCounter().stream(0, shape)
    make = rng.normal if random_ops.DISTRIBUTIONS[dist][0] == "normal" else rng.uniform
    draw = make(rng.whole(shape), shape, stream, torch.float32, "cpu")
    x = random_ops.distribution(lambda kind, *a: resolve_op(kind)(*a), draw, dist, params)
    se = std / len(x) ** 0.5
    assert abs(float(x.double().mean()) - mean) < 5 * se
    assert abs(float(x.double().std()) - std) < 0.01 * std
    if dist == "uniform":
        assert params[0] <= float(x.min()) and float(x.max()) < params[1]
    if dist == "exponential":
        assert float(x.min()) >= 0


class Draws(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc, self.how = nn.Linear(8, 8), how

    def forward(self, x):
        h = self.fc(x)
        if self.how == "randperm":
            h = h[:, torch.randperm(8)]
        elif self.how == "normal":
            h = torch.normal(h, 0.1)
        elif self.how == "multinomial":
            h = h * torch.multinomial(h.softmax(-1), 1)
        return h.square().mean()


@pytest.mark.parametrize("how", ["randperm", "normal", "multinomial"])
def test_a_draw_meshplan_cannot_place_is_refused_in_one_line(how):
    with pytest.raises(CaptureError, match=r"draws random numbers from torch's generator, "
                                           r"which differ by rank and layout.*test_draws.py") \
            as err:
        mp.capture(Draws(how), (torch.randn(4, 8),))
    assert "\n" not in str(err.value)


def test_an_lstm_without_dropout_draws_nothing():
    """aten's RNN ops are tagged random for their dropout; at 0 they draw nothing."""
    lstm = nn.LSTM(8, 8, batch_first=True)
    x = torch.randn(2, 3, 8)
    op = torch.ops.aten.lstm.input
    args = (x, (), [], True, 1, 0.0, True, False, True)
    assert not random_ops.draws(op, args, {})
    assert random_ops.draws(op, (*args[:5], 0.1, *args[6:]), {})
    assert not random_ops.draws(op, (*args[:5], 0.1, False, *args[7:]), {})
    mp.capture(lstm, (x,), loss_fn=lambda out: out[0].square().mean())
