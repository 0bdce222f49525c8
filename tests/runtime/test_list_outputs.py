"""An op returning a list of one tensor (`split` into one piece, schema
`-> Tensor[]`) is bound by unpacking: its value is the tensor, not the list
(transformers' inkling2 failed here: `pow` was handed a list)."""

from __future__ import annotations

import torch
from torch import nn

import meshplan.api as mp
from meshplan.autodiff import OptimizerConfig
from meshplan.driver.compare import Bounds
from meshplan.driver.verify import against_eager
from meshplan.runtime.local import local_ranks, train_local


class OnePiece(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        (piece,) = self.fc(x).split(8, dim=-1)  # one piece: a list of one tensor
        return nn.functional.mse_loss(piece.pow(2).mean(-1), y)


def test_a_list_of_one_tensor_is_the_tensor():
    torch.manual_seed(0)
    module = OnePiece()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, generator=g)) for _ in range(2)]
    job = mp.plan(mp.capture(module, data[0]), mp.Mesh(1, 1),
                  mp.Strategy(global_batch_size=4, micro_batch_size=4))
    assert any(op.kind == "aten.split.Tensor" and len(op.outputs) == 1 for op in job.graph.ops)
    hub, ranks = local_ranks(job, module, timeout_s=30)
    run = train_local(job, hub, ranks, data, timeout_s=30)
    verdict, _ = against_eager(run.rank_losses, run.slices, module, data, 1,
                               OptimizerConfig.default("sgd"),
                               bounds=Bounds(loss_atol=1e-6, atol=1e-6, rtol=1e-6))
    assert verdict["ok"], verdict["problems"]
