"""A masked `scaled_dot_product_attention` (BART's, T5's position bias)
splits its batch or its heads, and its gradient (the generic vjp) takes the
forward's splits: a mask broadcast over the split dim gets a Partial
gradient, summed across the axis. A learned bias broadcast over the batch,
at dp2, and over nothing, at tp2 (heads), trains equal to eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import meshplan.api as mp
from meshplan.ir import DType, Phase, TensorMeta
from meshplan.ir.kinds import ALL_GATHER, VJP
from meshplan.ir.sbp import Partial, Shard
from meshplan.ops.table import rule_for

H, T, D = 4, 6, 8


class BiasedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D) for _ in range(3))
        self.o = nn.Linear(D, D)
        self.bias = nn.Parameter(torch.randn(1, H, T, T) * 0.1)  # broadcast over the batch

    def forward(self, x, y):
        b = x.shape[0]
        q, k, v = (f(x).view(b, T, H, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return F.mse_loss(self.o(a.transpose(1, 2).reshape(b, T, D)), y)


def batches(n: int):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, T, D, generator=g), torch.randn(4, T, D, generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("fields", [dict(dp=2), dict(tp=2, tp_plan=(
    (r"[qkv]", "colwise"), (r"o", "rowwise")))], ids=["dp2", "tp2"])
def test_a_learned_mask_trains_as_eager(fields):
    torch.manual_seed(0)
    model = BiasedAttention()
    graph = mp.capture(model, batches(1)[0])
    s = mp.Strategy(global_batch_size=4, micro_batch_size=2 if "dp" in fields else 4, **fields)
    job = mp.plan(graph, mp.Mesh(1, 2), s, optimizer="adamw", lr=0.01)
    if "tp" in fields:  # heads split: q, k, v never gathered in the forward
        assert not [op for op in job.graph.ops
                    if op.kind == ALL_GATHER and op.phase is Phase.FORWARD]
    r = mp.verify(job, model, batches(3))
    assert r["ok"], r["problems"]
    assert r["params"]["bias"]["max_abs"] <= 1e-6


def test_a_broadcast_mask_gets_a_partial_gradient_under_a_batch_split():
    f32 = DType("float32")
    q = TensorMeta((4, H, T, D // H), f32)
    mask = TensorMeta((1, H, T, T), f32)
    fwd = (q, q, q, mask)
    sigs = rule_for(VJP).sbp(("aten.scaled_dot_product_attention.default", fwd, (), (q,),
                              (0, 3)), {}, (q, mask), 2)
    batch = next(s for s in sigs if s.ins[0] == Shard(0))
    assert batch.ins[3] != Shard(0) and batch.outs == (Shard(0), Partial())
    heads = next(s for s in sigs if s.ins[0] == Shard(1))
    assert heads.outs == (Shard(1), Shard(1))  # the mask splits with the heads
