"""Models with a `torch.autograd.Function` whose backward is its own, for
tests/capture/test_functions.py. At a module's top level, so that a rank's
process imports them by name."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RoundSTE(torch.autograd.Function):
    """A straight-through estimator: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class Reverse(torch.autograd.Function):
    """A gradient reversal layer: a view of its input forward, -g backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class ScaledPair(torch.autograd.Function):
    """Arguments of every kind meshplan keeps (a tensor in a dict, a dtype,
    numbers, None) and outputs with a None among them; a backward that
    clips the gradient of `a` and gives `b` none."""

    @staticmethod
    def forward(ctx, a, cfg, b, dtype, scale=1.0, nothing=None):
        ctx.save_for_backward(a, cfg["w"])
        ctx.scale = scale * cfg["k"]
        return (a * cfg["w"] * ctx.scale).to(dtype), None, b.argmax(-1)

    @staticmethod
    def backward(ctx, g, _none, _idx):
        a, w = ctx.saved_tensors
        return ((g * w * ctx.scale).clamp(-0.01, 0.01), None, None, None, None, None)


class Drawing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * torch.rand_like(x)

    @staticmethod
    def backward(ctx, g):
        return g


class Dirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Net(nn.Module):
    """Linear, the Function `kind` picks, Linear, MSE."""

    def __init__(self, kind: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.kind = kind

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.fc1(x)
        if self.kind == "straight-through":
            h = RoundSTE.apply(h * 4) / 4
        elif self.kind == "reversal":
            h = h + 0.5 * Reverse.apply(h)
        elif self.kind == "kinds":
            out, none, idx = ScaledPair.apply(h, {"w": self.w, "k": 3}, x, torch.float32,
                                              scale=0.5)
            assert none is None
            h = out + idx.unsqueeze(-1).float()
        elif self.kind == "interleaved":  # one Function, another of other outputs, the first
            a = RoundSTE.apply(h * 4) / 4
            out, _, _ = ScaledPair.apply(h, {"w": self.w, "k": 3}, x, torch.float32)
            h = a + out + RoundSTE.apply(h * 2) / 2
        elif self.kind == "no backward":  # nothing to differentiate: traced through
            with torch.no_grad():
                h = h + RoundSTE.apply(h * 4)
            h = h + RoundSTE.apply(x)
        elif self.kind == "draws":
            h = Drawing.apply(h)
        elif self.kind == "dirty":
            h = Dirty.apply(h * 1)
        return nn.functional.mse_loss(self.fc2(torch.tanh(h)), y)


def batches(steps: int, size: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 8, generator=g))
            for _ in range(steps)]



class MixedMatmul(torch.autograd.Function):
    """YOSO's form: a matmul of a bf16 operand and an fp32 one, which runs
    only under autocast (as eager applies it); a backward that casts."""

    @staticmethod
    def forward(ctx, q, w):
        ctx.save_for_backward(q, w)
        return torch.matmul(q, w)

    @staticmethod
    def backward(ctx, g):
        q, w = ctx.saved_tensors
        return torch.matmul(g, w.t().to(g.dtype)), torch.matmul(q.t().to(g.dtype), g).to(w.dtype)


class Mixed(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.w = nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x):
        return MixedMatmul.apply(self.q(x), self.w).float().pow(2).mean()
