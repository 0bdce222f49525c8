"""Ops outside the hand-written SBP table keep a split activation split
(`ops/sbp_table.sbp_rule`): what torch tags pointwise, the casts
(`type_as`, `.to(...)`), a per-element loss. Before, each was replicated:
correct, but dp gathered the whole batch to meet it, forward and backward.
Judged by the plan's collectives and against eager."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import meshplan.api as mp
from meshplan.ir.kinds import ALL_GATHER
from meshplan.ops import sbp_table, table

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Casts(nn.Module):
    """What transformers' norms and activations do: a float64 RMS with a
    `type_as` back, an erf GELU, softplus, a where against a number, `.to`
    the input's device and dtype; an MSE loss."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.w = nn.Parameter(torch.ones(16))

    def forward(self, x, y):
        h = self.fc1(x)
        v = h.to(torch.float64).square().mean(-1, keepdim=True)
        h = (h * torch.rsqrt(v + 1e-6)).type_as(h) * self.w
        h = h * 0.5 * (1 + torch.erf(h / 1.41)) + nn.functional.softplus(h)
        h = torch.where(h > 0, h, 0.1).to(x.device).to(dtype=x.dtype, device=x.device)
        return nn.functional.mse_loss(self.fc2(h), y)


def _batches(steps: int = 2):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g))
            for _ in range(steps)]


def _job(dp: int = 2):
    torch.manual_seed(0)
    module, data = Casts(), _batches()
    graph = mp.capture(module, tuple(t[:4] for t in data[0]))
    strategy = mp.Strategy(dp=dp, global_batch_size=8, micro_batch_size=4 // dp)
    return mp.plan(graph, mp.Mesh(1, dp), strategy), module, data


def _gathers(job) -> Counter:
    return Counter(op.phase.name for op in job.graph.ops if op.kind == ALL_GATHER)


@pytest.fixture
def fresh_rules():
    table.rule_for.cache_clear()
    yield
    table.rule_for.cache_clear()


def test_casts_and_pointwise_ops_keep_the_batch_split_and_train_as_eager():
    job, module, data = _job()
    kinds = {op.kind for op in job.graph.ops}
    assert "aten.type_as.default" not in kinds and "aten.to.dtype_layout" not in kinds
    assert {"aten.erf.default", "aten.softplus.default"} <= kinds
    assert not _gathers(job), _gathers(job)
    result = mp.verify(job, module, data, timeout_s=60)
    assert result.ok and result.max_abs_diff <= 1e-6, result.problems


def test_planted_ops_left_whole_gather_the_batch(monkeypatch, fresh_rules):
    """The rule table as it was: torch's pointwise tag unread, so dp
    gathers the activations to meet erf and softplus, and the check above
    would fail."""
    monkeypatch.setattr(table, "sbp_rule", lambda kind: sbp_table.SBP.get(
        kind, sbp_table.replicated_rule))
    job, _, _ = _job()
    assert _gathers(job)["FORWARD"] >= 2, _gathers(job)


def test_esm_at_dp2_gathers_no_activation():
    """A transformers model whose norm casts with `type_as` and whose GELU
    is erf (ESM): the batch stays split through every layer."""
    pytest.importorskip("transformers")
    from meshplan.driver.plan import plan_model, zoo_strategy
    from meshplan.models import model_config

    cfg = model_config("hf:esm", "tiny")
    s = zoo_strategy("hf:esm", cfg, dp=2, global_batch_size=4, micro_batch_size=2)
    job = plan_model("hf:esm", "tiny", mp.Mesh(1, 2), s, "sgd", None).job
    assert not _gathers(job), _gathers(job)


class ChannelsLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x, y):
        h = self.conv(x).to(x.device, memory_format=torch.channels_last)
        return nn.functional.mse_loss(h.mean((2, 3)), y)


def test_a_cast_to_channels_last_is_one_line():
    """The IR carries no memory formats (a cast is `_to_copy` or nothing),
    so a cast asking for one is refused, as `clone` to one is."""
    from meshplan.errors import CaptureError

    with pytest.raises(CaptureError) as e:
        mp.capture(ChannelsLast(), (torch.randn(2, 3, 8, 8), torch.randn(2, 4)))
    assert "\n" not in str(e.value) and "channels_last is not supported" in str(e.value)
