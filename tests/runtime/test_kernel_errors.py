"""A kernel that fails at run time is one line naming the op, its module
path and source line, never a traceback: exit 2 when the input is at fault,
exit 1 when meshplan is (`rank_executor._kernel_error`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshplan.autodiff import build_train_step
from meshplan.capture import capture
from meshplan.driver.executor import Executor
from meshplan.errors import KernelFault, MeshplanError


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, idx):
        return self.emb(idx).pow(2).mean()


def _executor():
    torch.manual_seed(0)
    model = Lookup()
    ex = Executor(build_train_step(capture(model, (torch.zeros(2, 3, dtype=torch.long),))))
    return ex, ex.init_state(model)


def test_an_index_out_of_range_is_the_inputs_fault():
    ex, state = _executor()
    with pytest.raises(KernelFault) as e:
        ex.step(state, [(torch.full((2, 3), 12, dtype=torch.long),)])
    message = str(e.value)
    assert isinstance(e.value, MeshplanError) and e.value.exit_code == 2
    assert "\n" not in message and "module 'emb'" in message and "on its input" in message


def test_a_kernel_failing_otherwise_is_meshplans_fault(monkeypatch):
    ex, state = _executor()
    fn = next(iter(ex.rank.segments.values()))[0]
    key = next(iter(ex.rank.segments))

    def boom(env, mem):
        raise RuntimeError("boom")

    boom.line_ops = fn.line_ops
    seg = ex.rank.segments[key]
    ex.rank.segments[key] = (boom,) + tuple(seg[1:])
    with pytest.raises(KernelFault) as e:
        ex.step(state, [(torch.zeros(2, 3, dtype=torch.long),)])
    assert e.value.exit_code == 1 and "boom" in str(e.value) and "report it" in str(e.value)


class FillsFp32Min(nn.Module):
    """DeBERTa's mask: `torch.finfo(torch.float32).min` into bf16 scores,
    which eager autocast refuses alike."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x):
        scores = self.q(x)
        return scores.masked_fill(x > 0, torch.finfo(torch.float32).min).float().mean()


def test_a_value_a_low_dtype_cannot_hold_is_the_models_fault():
    from meshplan.passes.precision import apply_precision

    model, x = FillsFp32Min(), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="without overflow"), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)  # eager's own failure
    graph = apply_precision(capture(model, (x,), precision="bf16"), "bf16")
    ex = Executor(build_train_step(graph))
    with pytest.raises(KernelFault) as e:
        ex.step(ex.init_state(model), [(x,)])
    message = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in message and "module 'q'" not in message
    assert "--precision fp32" in message and "masked_fill" in message
