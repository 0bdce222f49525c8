"""Ring attention's block arithmetic (`runtime/ring_attention.py`) on runs of
tokens that do not line up (pairs that are partly visible, rows that start
past a block's first keys): one member holding every block, against causal
attention at the same positions computed whole by autograd. The ring's
passing itself is tested over ranks by the SBP signature test and the
models' equal-to-eager tests."""

from __future__ import annotations

import pytest
import torch

from meshplan.runtime.ring_attention import ring_attention, ring_attention_backward

aten = torch.ops.aten
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _positions(runs):
    return [t for _, first, n in runs for t in range(first, first + n)]


def _home(x, step):  # a ring of one: what is sent comes back
    return lambda: x


@pytest.mark.parametrize("rows, keys", [
    (((0, 4, 3), (3, 10, 5)), ((0, 2, 4), (4, 9, 7))),   # partly visible pairs
    (((0, 4, 6),), ((0, 0, 2), (2, 6, 3))),               # rows before a run's keys
    (((0, 0, 6),), ((0, 0, 6),)),                         # a run against itself
    (((0, 6, 2), (2, 0, 2)), ((0, 0, 8),)),               # rows out of order
])
def test_blocks_merge_to_causal_attention_at_their_positions(rows, keys):
    torch.manual_seed(0)
    qpos, kpos = _positions(rows), _positions(keys)
    q = torch.randn(2, 3, len(qpos), 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, len(kpos), 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, len(kpos), 8, dtype=torch.float64, requires_grad=True)
    see = torch.tensor(kpos)[None, :] <= torch.tensor(qpos)[:, None]
    assert see.any(1).all(), "every row sees a key"
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=see)
    g = torch.randn_like(want)
    want.backward(g)

    out, lse = ring_attention(FWD, rows, [keys], 0, _home)(q.detach(), k.detach(),
                                                            v.detach(), 0.0, True)
    torch.testing.assert_close(out, want.detach(), rtol=1e-9, atol=1e-9)
    dq, dk, dv = ring_attention_backward(BWD, rows, [keys], 0, _home)(
        g, q.detach(), k.detach(), v.detach(), out, lse, 0.0, True)
    for got, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
