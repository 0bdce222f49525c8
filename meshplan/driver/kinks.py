"""The eager reference with each ReLU's derivative taken on the other side
wherever fp32 cannot tell which side of the kink an element is on.

ReLU's derivative jumps from 0 to 1 at 0. An element whose input is within
fp32's rounding of 0 (CTRL tiny: 5 of a layer's million, the closest at
3.6e-8 where fp32 is 3e-7 from float64) falls on either side as the rounding
goes, and a plan rounds otherwise than eager (cp's attention sums its keys
in blocks): one flipped element moves a whole row of the next gradient, by
1% of it. Neither side is wrong. `KinksFlipped` is a `TorchFunctionMode`
for the judge's second chance only (`verify.against_eager`): the forward is
the module's, bit for bit; the backward of every ReLU (`F.relu`,
`torch.relu`, `Tensor.relu` and their in-place forms: `nn.ReLU` and
transformers' "relu") takes the other side at each element within `WINDOW`
of 0, relative to that call's largest input. Its distance from the
reference is noise a plan may show, as float64's is.

Other kinks (clamp, hardtanh, abs, max-pooling, a router's top-k) are not
flipped: a plan that falls on their other side is still refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

WINDOW = 1e-6  # ~3x fp32's own error on a layer's pre-activations (CTRL tiny: 3-4e-7)


class _FlippedRelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        near = x.abs() <= WINDOW * x.abs().max()
        ctx.on = (x > 0) ^ near  # a mask, not `x`: an in-place ReLU overwrites it
        return torch.relu(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.on


_RELU = {torch.relu, F.relu, torch.Tensor.relu}
_IN_PLACE = {torch.relu_, F.relu_, torch.Tensor.relu_}


class KinksFlipped(TorchFunctionMode):
    """ReLUs whose backward takes the other side near 0 (see the module)."""

    def __init__(self):
        super().__init__()
        self.calls = 0  # ReLUs flipped: none, and the run is the reference's itself

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RELU or func in _IN_PLACE:
            x = args[0]
            in_place = func in _IN_PLACE or kwargs.get("inplace", False) or \
                (func is F.relu and len(args) > 1 and bool(args[1]))
            if torch.is_grad_enabled() and x.requires_grad and x.numel():
                self.calls += 1
                out = _FlippedRelu.apply(x)
                return x.copy_(out) if in_place else out
        return func(*args, **kwargs)
