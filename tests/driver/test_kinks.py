"""The judge's kink noise (`driver/kinks.py`): a ReLU whose input is within
fp32's rounding of 0 may fall on either side in a plan, and the judge
allows what that moves, where it moves it, and nothing else."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshplan.driver import kinks
from meshplan.driver.kinks import KinksFlipped

Z = [1.0, -1.0, 1e-8, -1e-8, 0.5]
PLAIN, FLIPPED = [1.0, 0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("relu", [
    F.relu, torch.relu, torch.Tensor.relu, nn.ReLU(), nn.ReLU(inplace=True),
    lambda x: F.relu(x, True), torch.relu_, torch.Tensor.relu_, F.relu_],
    ids=["F.relu", "torch.relu", "Tensor.relu", "nn.ReLU", "nn.ReLU-inplace",
         "F.relu-inplace", "torch.relu_", "Tensor.relu_", "F.relu_"])
def test_a_relu_keeps_its_forward_and_flips_its_derivative_only_near_zero(relu):
    def grad(mode):
        z = torch.tensor(Z, requires_grad=True)
        with mode:
            y = relu(z * 1.0)  # not a leaf: the in-place forms may write it
        (y * torch.arange(1.0, 6.0)).sum().backward()
        return y.detach(), z.grad

    mode = KinksFlipped()
    y0, g0 = grad(nullcontext())
    y1, g1 = grad(mode)
    assert torch.equal(y0, y1) and mode.calls == 1
    assert g0.tolist() == [p * k for p, k in zip(PLAIN, range(1, 6))]
    assert g1.tolist() == [f * k for f, k in zip(FLIPPED, range(1, 6))]


def test_without_gradients_a_relu_is_left_alone():
    mode = KinksFlipped()
    with torch.no_grad(), mode:
        y = F.relu(torch.tensor(Z))
    assert mode.calls == 0 and torch.equal(y, torch.tensor(Z).clamp_min(0))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def test_a_relu_flipped_by_a_plans_rounding_is_noise_and_a_bug_is_not(monkeypatch):
    """CTRL tiny (seed 2) at cp2 put one ReLU input, 3.6e-8 from 0, on the
    other side of it: a row of a momentum buffer 1% off, the losses
    bit-equal, and the run refused (the twin and float64 had not flipped
    it). Here two inputs sit at the kink, one at exactly 0 and one 1e-7
    above it; the run flips the first alone, as a plan's rounding may: it
    is refused without the kink noise and passed with it, and a row no flip
    touched, a little off, is refused with it."""
    from meshplan.autodiff import OptimizerConfig
    from meshplan.driver.compare import BOUNDS
    from meshplan.driver.reference import eager_train
    from meshplan.driver.verify import exact_train, judge, reordered, whole_slices
    from meshplan.ir.choices import Precision

    torch.manual_seed(0)
    module = Mlp()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    x[0] = 0.0  # sample 0 meets unit 3 at exactly 0
    with torch.no_grad():
        module.fc1.bias[3] = 0.0
        module.fc1.bias[5] -= module.fc1(x[1:2])[0, 5] - 1e-7  # sample 1, unit 5: 1e-7 above
    batches = [(x, y), (x, y)]
    opt = OptimizerConfig.default("sgd")

    def train(**kw):
        return eager_train(copy.deepcopy(module), batches, 1, opt, **kw)

    ref, twin = train(), eager_train(copy.deepcopy(module), reordered(batches, 1), 1, opt)
    exact, flipped = exact_train(module, batches, 1, opt, "cpu", None), train(flip_kinks=True)
    with monkeypatch.context() as m:
        m.setattr(kinks, "WINDOW", 1e-9)  # the input at 0 alone
        run = train(flip_kinks=True)
    assert not torch.equal(run.state["fc1.weight"], flipped.state["fc1.weight"])

    def verdict(state, with_kinks):
        return judge({"0": list(run.losses)}, whole_slices(state), ref, BOUNDS[Precision.FP32],
                     twin, exact=exact, flipped=flipped if with_kinks else None)

    assert verdict(run.state, True)["ok"], verdict(run.state, True)["problems"]
    assert not verdict(run.state, False)["ok"]
    # a row no flip touched, 5e-5 off (3x its bound): the kink noise is
    # elementwise, ~1e-7 there (the tensor's largest, 3e-5, would allow it)
    wrong = run.state["fc1.weight"].clone()
    wrong[0] += 5e-5
    assert not verdict(dict(run.state, **{"fc1.weight": wrong}), True)["ok"]
