"""A parameter with `requires_grad` off is never trained, as in eager torch
(a frozen embedding, Marian's sinusoidal position table). Before, capture
took every parameter as trained: weight decay and the update moved a frozen
table silently (Marian's by 3e-4 in two SGD steps)."""

from __future__ import annotations

import torch
from torch import nn

import meshplan.api as mp
from meshplan.ir import Role


class FrozenTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(16, 8)
        self.table.weight.requires_grad_(False)
        self.head = nn.Linear(8, 16)

    def forward(self, ids, y):
        return nn.functional.cross_entropy(self.head(self.table(ids)).flatten(0, 1),
                                           y.flatten())


def batches(n: int):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 16, (4, 5), generator=g),
             torch.randint(0, 16, (4, 5), generator=g)) for _ in range(n)]


def test_a_frozen_parameter_is_state_not_trained():
    torch.manual_seed(0)
    model = FrozenTable()
    graph = mp.capture(model, batches(1)[0])
    roles = {graph.values[v].name: graph.values[v].role for v in graph.inputs}
    assert roles["table.weight"] is Role.BUFFER and roles["head.weight"] is Role.PARAM
    job = mp.plan(graph, mp.Mesh(1, 2), mp.Strategy(dp=2, global_batch_size=4, micro_batch_size=2),
                  optimizer="adamw", lr=0.1)
    r = mp.verify(job, model, batches(3))
    assert r["ok"], r["problems"]
    assert r["params"]["table.weight"]["max_abs"] == 0  # eager's is unchanged
