"""Custom ops a model may bring (`torch.library`), for tests/ops/test_custom_ops.py:
one with a fake kernel and an autograd formula, one without a formula, and
a module using the first. Imported by name, so a rank's process finds them."""

from __future__ import annotations

import torch
from torch import Tensor, nn


@torch.library.custom_op("meshplan_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: Tensor, w: Tensor) -> Tensor:
    """tanh(x) * w, w broadcast over x's last dimension."""
    return torch.tanh(x) * w


@scaled_tanh.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, g: Tensor) -> tuple[Tensor, Tensor]:
    x, w = ctx.saved_tensors
    t = torch.tanh(x)
    return g * w * (1 - t * t), (g * t).reshape(-1, w.numel()).sum(0)


scaled_tanh.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("meshplan_test::no_formula", mutates_args=())
def no_formula(x: Tensor) -> Tensor:
    """2x, with a fake kernel and no autograd formula."""
    return x * 2


@no_formula.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


class Net(nn.Module):
    """Linear, the custom op (learned scale), Linear, MSE; `op` picks the op."""

    def __init__(self, op: str = "scaled_tanh"):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 1)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.op = op

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.fc1(x)
        h = scaled_tanh(h, self.scale) if self.op == "scaled_tanh" else no_formula(h)
        return nn.functional.mse_loss(self.fc2(h).squeeze(-1), y)


def batches(steps: int, size: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, generator=g))
            for _ in range(steps)]
