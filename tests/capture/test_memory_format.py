"""Memory formats at capture: the IR carries none. `preserve_format` (the
*_like ops' default) is left out, a *_like op's `contiguous_format` runs on
its input made contiguous, and channels_last is refused in one line
(transformers' phimoe failed at run time: the format reached the kernel as
a string)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshplan.api as mp
from meshplan.errors import CaptureError
from meshplan.runtime.local import local_ranks, train_local


class Like(nn.Module):
    def __init__(self, fmt):
        super().__init__()
        self.fc, self.fmt = nn.Linear(8, 8), fmt

    def forward(self, x, y):
        h = self.fc(x).t()  # not contiguous
        ones = torch.ones_like(h, memory_format=self.fmt)
        return nn.functional.mse_loss((h * ones).t().reshape(-1, 8).sum(-1), y)


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, generator=g))]


@pytest.mark.parametrize("fmt", [torch.preserve_format, torch.contiguous_format])
def test_a_like_ops_format_is_kept_as_its_meaning(fmt):
    torch.manual_seed(0)
    module, data = Like(fmt), _data()
    job = mp.plan(mp.capture(module, data[0]), mp.Mesh(1, 1),
                  mp.Strategy(global_batch_size=4, micro_batch_size=4))
    assert all("memory_format" not in dict(op.kwargs) for op in job.graph.ops)
    hub, ranks = local_ranks(job, module, timeout_s=30)
    run = train_local(job, hub, ranks, data, timeout_s=30)
    assert run.losses[0] == pytest.approx(module(*data[0]).item(), abs=1e-6)


class ChannelsLast(Like):
    def forward(self, x, y):
        h = self.fc(x).reshape(4, 2, 2, 2)
        ones = torch.ones_like(h, memory_format=torch.channels_last)
        return nn.functional.mse_loss((h * ones).reshape(4, 8).sum(-1), y)


def test_channels_last_is_refused():
    with pytest.raises(CaptureError, match="memory format torch.channels_last is not supported"):
        mp.capture(ChannelsLast(None), _data()[0])
