"""The generic rule (`ops/generic.py`): ops outside the exact set train like
eager torch through `meshplan.vjp`, and unsupportable ops fail at capture
with a one-line `CaptureError` that says what and where."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshplan.autodiff.backward import build_train_step
from meshplan.autodiff.optimizer import OptimizerConfig, torch_optimizer
from meshplan.capture import capture
from meshplan.driver.executor import Executor
from meshplan.errors import CaptureError
from meshplan.ops.table import exact_kinds

GENERIC_KINDS = {
    "aten.erf.default", "aten.cumsum.default", "aten.atan2.default", "aten.softplus.default",
    "aten.clamp.default", "aten.where.self", "aten.logsumexp.default",
}


class Unusual(nn.Module):
    """A regression head built from ops that have no exact rule."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.rand(6) + 0.5)
        self.denom = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x, y):
        h = torch.erf(self.lin(x)) * self.scale
        h = torch.cumsum(h, dim=-1)
        h = torch.atan2(h, self.denom)
        h = F.softplus(h, beta=2.0)
        h = torch.clamp(h, min=0.05, max=1.5)
        h = torch.where(x > 0, h, -h)
        return ((torch.logsumexp(h, dim=-1) - y) ** 2).mean()


def test_generic_ops_train_like_eager():
    torch.manual_seed(0)
    model = Unusual()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen), torch.randn(8, generator=gen))
               for _ in range(20)]
    opt_cfg = OptimizerConfig("sgd", lr=0.1, momentum=0.9, weight_decay=0.0)

    step = build_train_step(capture(model, batches[0]), opt_cfg)
    vjp_kinds = {op.args[0] for op in step.ops if op.kind == "meshplan.vjp"}
    assert GENERIC_KINDS <= vjp_kinds, sorted(GENERIC_KINDS - vjp_kinds)
    assert not vjp_kinds & exact_kinds()
    ex = Executor(step)
    state = ex.init_state(model)
    ours = [ex.step(state, [b]) for b in batches]

    opt = torch_optimizer(opt_cfg, model)
    theirs = []
    for b in batches:
        opt.zero_grad()
        loss = model(*b)
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    assert diff <= 1e-5, f"max |loss diff| over 20 steps: {diff:.3g}"
    for name, p in model.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)


class _Pick(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        idx = torch.nonzero(x > 0)  # data-dependent number of rows
        return self.w[idx[:, 0]].sum()


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pick = _Pick()

    def forward(self, x):
        return self.pick(x)


def test_data_dependent_shape_fails_at_capture_with_one_line():
    with pytest.raises(CaptureError) as info:
        capture(_Outer(), (torch.randn(6),))
    msg = str(info.value)
    assert "\n" not in msg
    assert "aten.nonzero" in msg
    assert "module 'pick'" in msg
    line = inspect.getsourcelines(_Pick.forward)[1] + 1
    assert f"test_generic.py, line {line}" in msg, msg
    assert "torch.nonzero(x > 0)" in msg


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(6, 6, batch_first=True, num_layers=2)

    def forward(self, x, y):
        out, _ = self.rnn(x)
        return F.mse_loss(out[:, -1], y)


def test_the_vjp_kernel_differentiates_whatever_the_callers_grad_mode():
    """An LSTM saves its workspace for backward only with grad mode on: the
    vjp kernel's forward turns it on itself. Under the capture self-check's
    no_grad, the backward once failed ('Expected a proper Tensor but got
    None ... workspace'), and capturing any LSTM raised it."""
    torch.manual_seed(0)
    model = _Recurrent()
    batch = (torch.randn(2, 3, 6), torch.randn(2, 6))
    step = build_train_step(capture(model, batch), OptimizerConfig("sgd", lr=0.1))
    after = []  # the weights after one step, with grad mode on, then off
    for mode in (torch.enable_grad, torch.no_grad):
        ex = Executor(step)
        state = ex.init_state(model)
        with mode():
            ex.step(state, [batch])
        after.append({n: state[n].clone() for n, _ in model.named_parameters()})
    model(*batch).backward()  # and the step is eager's
    for name, p in model.named_parameters():
        torch.testing.assert_close(after[1][name], after[0][name], msg=name)
        torch.testing.assert_close(after[0][name], p.detach() - 0.1 * p.grad, msg=name)
