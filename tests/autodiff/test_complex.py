"""A gradient flows through complex values: an FFT mixing layer (FNet's)
trains equal to eager. Before, the complex output was left out of the
values needing a gradient, which cut the gradient of every layer below it
silently (the loss of step 0 agreed; step 1's did not)."""

from __future__ import annotations

import torch
from torch import nn

import meshplan.api as mp


class FourierMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x, y):
        h = torch.fft.fftn(self.inp(x), dim=(1, 2)).real
        return nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def test_an_fft_layer_trains_as_eager():
    torch.manual_seed(0)
    model = FourierMix()
    batches = [(torch.randn(4, 6, 8), torch.randn(4, 6)) for _ in range(3)]
    graph = mp.capture(model, batches[0])
    job = mp.plan(graph, mp.Mesh(1, 1), mp.Strategy(global_batch_size=4, micro_batch_size=4))
    r = mp.verify(job, model, batches)
    assert r["ok"], r["problems"]
    assert r["params"]["inp.weight"]["max_abs"] <= 1e-6  # the layer below the FFT trains
