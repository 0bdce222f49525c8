"""Small custom modules that capture or planning must refuse, one per
mistake. Each is plain `nn.Module` code a user could write."""

from __future__ import annotations

import torch
from torch import nn

X = (4, 8)  # the example input's shape: (batch, features)


def example() -> tuple[torch.Tensor]:
    return (torch.randn(*X, generator=torch.Generator().manual_seed(0)),)


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(X[1], X[1])


class MaskedSum(_Base):
    """A boolean mask: the output's length depends on the data."""

    def forward(self, x):
        y = self.fc(x)
        return y[y > 0].sum()


class NonZero(_Base):
    def forward(self, x):
        return torch.nonzero(self.fc(x)).float().sum()


class Branch(_Base):
    """`torch.cond`: a higher-order op, neither aten nor generic."""

    def forward(self, x):
        y = self.fc(x)
        return torch.cond(y.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (y,)).sum()


class _Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # a recompute for the backward would draw other numbers
        return x * torch.rand_like(x)

    @staticmethod
    def backward(ctx, g):
        return g


class RandomFunction(_Base):
    """A `torch.autograd.Function` that draws random numbers in its forward."""

    def forward(self, x):
        return _Noisy.apply(self.fc(x)).square().mean()


class GradientHook(_Base):
    """A gradient hook in the forward: export's program drops it."""

    def forward(self, x):
        h = self.fc(x)
        if h.requires_grad:
            h.register_hook(lambda g: -g)
        return h.square().mean()


class TorchsDraw(_Base):
    """`torch.randperm`: its numbers would differ by rank and layout."""

    def forward(self, x):
        return self.fc(x)[:, torch.randperm(3)].square().mean()


class LargeConstant(_Base):
    """A tensor constant of 100 distinct elements made in the forward."""

    def forward(self, x):
        return (self.fc(x).sum() * torch.tensor([float(i) for i in range(100)])).mean()


class PythonBranch(_Base):
    """A Python `if` on a tensor's value: export cannot trace it."""

    def forward(self, x):
        y = self.fc(x)
        if y.sum().item() > 0:
            return y.sum()
        return y.mean()


class NoLoss(_Base):
    """Returns the activations, not a loss."""

    def forward(self, x):
        return self.fc(x)


class TwoOutputs(_Base):
    def forward(self, x):
        y = self.fc(x)
        return y.sum(), y.mean()


class IntegerLoss(_Base):
    def forward(self, x):
        return self.fc(x).argmax()


class Tied(nn.Module):
    """Two layers share one weight (as GPT-2 ties its embedding and head):
    with pp=2 it would be read on two stages."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(X[1], X[1]) for _ in range(2)])
        self.blocks[1].weight = self.blocks[0].weight

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x.sum()


class NoList(nn.Module):
    """Layers as plain attributes: no nn.ModuleList for a derived layer list."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(X[1], X[1]), nn.Linear(X[1], X[1])

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()
