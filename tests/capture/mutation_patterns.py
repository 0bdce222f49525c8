"""The mutation table: one small layered model per way of writing in place.

Each `Pattern` is a function `(layer, h) -> h'` that writes into a tensor
in one of the ways real models do (transformers' `_shift_right`, masks and
position ids built by slice assignment, BatchNorm's running stats, counters).
`Net` runs it inside every layer (`blocks.{i}`, between the MLP and the
residual add), so a pipeline cut and a tensor-parallel MLP surround it.
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH, SEQ, CLASSES, LAYERS = 16, 8, 5, 4


def slice_assign(layer, h):  # the issue's first row: transformers' _shift_right
    s = h.new_zeros(h.shape)
    s[..., 1:] = h[..., :-1].clone()
    return s


def fill_slice(layer, h):
    s = h.clone()
    s[..., 0] = 0.5
    return s


def add_on_view(layer, h):
    s = h.clone()
    s[:, :4].add_(1.0)
    return s


def masked_fill_whole(layer, h):
    s = h.clone()
    s.masked_fill_(s > 1, 1)
    return s


def bool_mask_assign(layer, h):  # index_put_ with a boolean mask
    s = h.clone()
    s[s < -0.5] = -0.5
    return s


def index_put(layer, h):  # index_put_ with integer indices
    s = h.clone()
    idx = torch.arange(0, SEQ, 2, device=h.device)
    s[:, idx] = h[:, idx] * 2.0
    return s


def constant_index(layer, h):  # positions picked by an index list the forward makes
    s = h.clone()  # (a tensor constant, its elements not all equal: made one by one)
    s[:, :4] = h[:, torch.tensor([6, 0, 3, 1])] * 2.0
    return s


def mul_on_view(layer, h):
    s = h.clone()
    s[..., ::2].mul_(0.5)
    return s


def masked_fill_on_view(layer, h):
    s = h.clone()
    tail = s[:, 1:]
    tail.masked_fill_(tail > 0.25, 0.0)
    return s


def scatter(layer, h):
    s = h.clone()
    s.scatter_(-1, h.argmax(-1, keepdim=True), 0.0)
    return s


def on_transpose(layer, h):
    s = h.clone()
    s.transpose(1, 2)[:, 0].add_(1.0)  # feature 0 at every position
    return s


def on_view(layer, h):
    s = h.clone()
    s.view(h.shape[0], -1)[:, :WIDTH].mul_(3.0)  # the first position's features
    return s


def chained_views(layer, h):
    s = h.clone()
    s[:, 1:][..., 0] = 2.0
    return s


def batch_norm(layer, h):  # a buffer updated in place: running mean and variance
    return layer.norm(h.transpose(1, 2)).transpose(1, 2)


def counter(layer, h):  # a buffer updated in place: a step counter the forward reads
    layer.calls.add_(1)
    return h * (1.0 + 0.0 * layer.calls)


def ema(layer, h):  # a buffer updated under no_grad from the activations (a running mean)
    with torch.no_grad():
        layer.ema.mul_(0.9).add_(0.1 * h.mean((0, 1)))
    return h - layer.ema


def written_only(layer, h):  # a buffer the forward writes and never reads (a statistic
    with torch.no_grad():  # kept for logging; spectral norm's `_u`)
        layer.last.copy_(h.mean((0, 1)))
    return h


def no_grad_scale(layer, h):  # a value computed under no_grad: a constant to the backward
    with torch.no_grad():
        scale = h.pow(2).mean().sqrt() + 1.0
    return h / scale


def enable_inside_no_grad(layer, h):  # enable_grad inside no_grad: the gradient flows
    with torch.no_grad():  # through h (from outside), not through `stat` (made inside)
        stat = h.abs().mean(-1, keepdim=True)
        with torch.enable_grad():
            h = h * stat
    return h


def autocast_inside_no_grad(layer, h):  # export nests this region inside the no_grad one
    with torch.no_grad():
        with torch.autocast("cpu", enabled=False):
            stat = h.abs().mean(-1, keepdim=True)
    return h * stat


def autocast_off(layer, h):  # an autocast region (off: an fp32 step computes the same)
    with torch.autocast("cpu", enabled=False):
        return h * 2.0 - 1.0


PATTERNS = {f.__name__: f for f in (
    slice_assign, fill_slice, add_on_view, masked_fill_whole, bool_mask_assign, index_put,
    constant_index, mul_on_view, masked_fill_on_view, scatter, on_transpose, on_view,
    chained_views, batch_norm, counter, ema, written_only, no_grad_scale, enable_inside_no_grad,
    autocast_inside_no_grad, autocast_off)}
INPUT_MUTATION = "input_mutated"  # the model writes into its own input tensor


class Block(nn.Module):
    def __init__(self, pattern: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.pattern = pattern
        if pattern == "batch_norm":
            self.norm = nn.BatchNorm1d(WIDTH)
        if pattern == "counter":
            self.register_buffer("calls", torch.zeros(()))
        if pattern == "ema":
            self.register_buffer("ema", torch.zeros(WIDTH))
        if pattern == "written_only":
            self.register_buffer("last", torch.zeros(WIDTH))

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(x)))
        if self.pattern in PATTERNS:
            h = PATTERNS[self.pattern](self, h)
        return x + h


class Net(nn.Module):
    """`LAYERS` blocks on (batch, SEQ, WIDTH) inputs, then a classifier."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern
        self.blocks = nn.ModuleList(Block(pattern) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, y):
        if self.pattern == INPUT_MUTATION:
            x[:, :, 0] = 0.0  # idempotent: eager may see the same batch twice
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x.mean(1)), y)


def batches(n: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, SEQ, WIDTH, generator=g),
             torch.randint(0, CLASSES, (batch,), generator=g)) for _ in range(n)]
