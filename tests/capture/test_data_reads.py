"""A forward that reads a tensor's value: a check on the data (`assert
x.max().item() <= n`, XLM's and FlauBERT's) is left out and the model trains
as eager; a value read and computed with (JetMoE's `.tolist()` split sizes),
or a branch on a value (FSMT's `if not mask.any()`), is one line naming the
model's own line."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import meshplan.api as mp
from meshplan.capture import export
from meshplan.errors import CaptureError
from tests.capture.data_checks import Checked  # asserts as written: pytest rewrites ours


def _checked():
    torch.manual_seed(0)
    return Checked(), [(torch.randn(4, 8), torch.randn(4)) for _ in range(3)]


def test_a_check_on_the_data_is_left_out_and_the_model_trains_as_eager():
    model, batches = _checked()
    graph = mp.capture(model, batches[0])
    assert not any("item" in op.kind or "sum" in op.kind for op in graph.ops)
    job = mp.plan(graph, mp.Mesh(1, 1), mp.Strategy(global_batch_size=4, micro_batch_size=4))
    r = mp.verify(job, model, batches)
    assert r["ok"], r["problems"]


def test_planted_a_check_kept_is_refused(monkeypatch):
    """Planted: nothing is left out; the `item` under the assert is refused."""
    monkeypatch.setattr(export, "_checks_only", lambda graph: set())
    model, batches = _checked()
    with pytest.raises(CaptureError, match="reads a tensor's value"):
        mp.capture(model, batches[0])


class SizedByValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x, y):
        route = (x[:, 0] > 0).long()  # JetMoE's router: rows per expert, read off the data
        counts = (route[:, None] == torch.arange(2)).sum(0)
        parts = self.fc(x[route.argsort()]).squeeze(-1).split(counts.tolist())
        return nn.functional.mse_loss(torch.cat([parts[0], parts[1] * 2]), y)


def test_a_value_read_and_computed_with_is_one_line():
    with pytest.raises(CaptureError) as e:
        mp.capture(SizedByValue(), (torch.randn(4, 8), torch.randn(4)))
    msg = str(e.value)
    assert "reads a tensor's value" in msg and "test_data_reads.py" in msg, msg
    assert "\n" not in msg


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x, y):
        h = self.fc(x).squeeze(-1)
        if (h > 0).any():  # a branch on a value
            h = h * 2
        return nn.functional.mse_loss(h, y)


def test_a_branch_on_a_value_names_the_models_line(capfd):
    line = next(i for i, ln in enumerate(inspect.getsource(Branches).splitlines())
                if "if (h > 0).any()" in ln) + inspect.getsourcelines(Branches)[1]
    with pytest.raises(CaptureError) as e:
        mp.capture(Branches(), (torch.randn(4, 8), torch.randn(4)))
    msg = str(e.value)
    assert f"test_data_reads.py, line {line} (`if (h > 0).any():  # a branch on a value`)" \
        in msg, msg
    assert "torch.where" in msg and "\n" not in msg and "Eq(" not in msg
    assert "def forward" not in capfd.readouterr().err  # torch prints its graph so far
