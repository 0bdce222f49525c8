"""The device kernel adapters keep the logical attention signature: the math
path (the fallback of every fused CUDA kernel) agrees with the CPU kernel the
Job names, forward and backward. Runs on CPU."""

from __future__ import annotations

import pytest
import torch

from meshplan.ops import device_kernels as dk
from meshplan.ops.table import rule_for


@pytest.mark.parametrize("causal", [False, True])
def test_math_adapter_matches_the_cpu_kernel(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 16, dtype=torch.float64) for _ in range(3))
    g = torch.randn(2, 3, 8, 16, dtype=torch.float64)
    out, lse = rule_for(dk.SDPA_CPU).kernel(q, k, v, 0.0, causal, scale=None)
    grads = rule_for(dk.SDPA_CPU_BACKWARD).kernel(g, q, k, v, out, lse, 0.0, causal,
                                                  attn_mask=None, scale=None)
    fwd, bwd = dk.adapter(dk.MATH), dk.adapter(dk.MATH_BACKWARD)
    mout, mlse = fwd(q, k, v, 0.0, causal, scale=None)
    assert mlse.numel() == 0  # "no saved statistics": a fused backward goes to math too
    torch.testing.assert_close(mout, out)
    for a, b in zip(bwd(g, q, k, v, mout, mlse, 0.0, causal, attn_mask=None, scale=None),
                    grads):
        torch.testing.assert_close(a, b)


def test_fused_backward_after_a_forward_fallback_takes_the_math_path():
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(1, 2, 4, 8) for _ in range(4))
    empty = torch.empty(0)
    want = dk.adapter(dk.MATH_BACKWARD)(g, q, k, v, None, empty, 0.0, True)
    for name in (dk.FLASH_BACKWARD, dk.EFFICIENT_BACKWARD):
        got = dk.adapter(name)(g, q, k, v, None, empty, 0.0, True, attn_mask=None, scale=None)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_an_unknown_kernel_name_says_recompile():
    from meshplan.errors import PlanError

    with pytest.raises(PlanError, match="recompile"):
        dk.adapter("aten.nope.default")
