"""The capture self-check (issue 29): a planted miscompile is refused, with
the op and its source line; a correct capture passes and leaves the module
as it was."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import meshplan.api as mp
from meshplan.autodiff import OptimizerConfig
from meshplan.driver import capture_check
from meshplan.driver.verify import against_eager
from meshplan.errors import CaptureError
from meshplan.ops import canonical
from meshplan.ops.table import rule_for
from meshplan.runtime.local import local_ranks, train_local
from tests.capture.mutation_patterns import Net, batches


def _identity_kernel(monkeypatch, kind: str) -> None:
    """The rule table's entry for `kind` returns its first input unchanged."""
    real = rule_for

    def planted(k):
        rule = real(k)
        return replace(rule, kernel=lambda x, *a, **kw: x) if k == kind else rule

    monkeypatch.setattr("meshplan.runtime.codegen.rule_for", planted)


class Shift(nn.Module):
    """The issue's module: a write through a view."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, y):
        s = x.new_zeros(x.shape)
        s[..., 1:] = x[..., :-1].clone()
        return nn.functional.mse_loss(self.lin(s).squeeze(-1), y)


def _example(pattern: str = "slice_assign"):
    torch.manual_seed(0)
    x, y = batches(1, 4)[0]
    return Net(pattern), (x, y)


def test_a_kernel_that_returns_its_input_is_named_with_its_source_line(monkeypatch):
    torch.manual_seed(0)
    module, inputs = Shift(), (torch.randn(4, 8), torch.randn(4))
    _identity_kernel(monkeypatch, "aten.slice_scatter.default")
    with pytest.raises(CaptureError) as err:
        mp.capture(module, inputs)
    msg = str(err.value)
    assert "\n" not in msg and "self_check=False" in msg
    assert "aten.slice_scatter.default at module '<root>'" in msg
    assert "test_self_check.py, line" in msg and "s[..., 1:] = x[..., :-1].clone()" in msg


def test_in_a_layer_the_op_names_its_module_path(monkeypatch):
    module, inputs = _example()
    _identity_kernel(monkeypatch, "aten.slice_scatter.default")
    with pytest.raises(CaptureError, match=r"aten.slice_scatter.default at module 'blocks.0'"):
        mp.capture(module, inputs)


def test_a_canonical_rewrite_that_drops_its_op_is_named(monkeypatch):
    """log_softmax's capture rewrite returns its input: the graph has no op
    for it, and the check names torch's op and the rewrite's stand-in."""
    monkeypatch.setitem(canonical.CANONICAL, "aten.log_softmax.int",
                        lambda e, args, kw, ctx: (args[0],))
    rule_for.cache_clear()
    try:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 3), nn.LogSoftmax(-1))
        with pytest.raises(CaptureError) as err:
            mp.capture(m, (torch.randn(2, 4),), loss_fn=lambda out: out.sum())
    finally:
        rule_for.cache_clear()
    assert ("aten.log_softmax.int (captured as aten.linear.default) at module '1'"
            in str(err.value)), str(err.value)


def test_opt_out_captures_the_miscompile_anyway(monkeypatch):
    module, inputs = _example()
    _identity_kernel(monkeypatch, "aten.slice_scatter.default")
    graph = mp.capture(module, inputs, self_check=False)
    assert any(op.kind == "aten.slice_scatter.default" for op in graph.ops)


def test_the_check_leaves_buffers_and_rng_as_they_were():
    module, inputs = _example("batch_norm")
    before = {n: b.clone() for n, b in module.named_buffers()}
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    mp.capture(module, inputs)
    assert torch.equal(torch.rand(3), expected)
    for n, b in module.named_buffers():
        assert torch.equal(b, before[n]), n


def test_dropout_draws_the_same_masks_on_both_sides():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    x = torch.randn(16, 8)
    mp.capture(m, (x,), loss_fn=lambda out: out.square().mean())  # passes: masks agree


def test_meta_inputs_are_not_checked(monkeypatch):
    calls = []
    monkeypatch.setattr(capture_check, "check_capture", lambda *a: calls.append(a))
    with torch.device("meta"):
        module = Net("slice_assign")
        x, y = torch.empty(4, 8, 16), torch.zeros(4, dtype=torch.long)
    mp.capture(module, (x, y))
    assert not calls
    mp.capture(*_example())
    assert len(calls) == 1


CALLS = [0]  # a Python global the forward counts its calls in


class Drifts(nn.Module):
    """A forward that reads a Python global it also changes: export bakes
    the value it saw, so its program is not the module."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        CALLS[0] += 1
        return (self.lin(x) * CALLS[0]).sum()


def test_a_program_that_is_not_the_module_is_blamed_on_export():
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="torch.export's program differs from the module"):
        mp.capture(Drifts(), (torch.randn(2, 4),))


class LostBackward(nn.Module):
    """A forward whose backward torch.export's program does not keep."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin, self.kind = nn.Linear(8, 8), kind

    def forward(self, x, y):
        h = self.lin(x)
        if self.kind == "hook":  # export drops it
            if h.requires_grad:
                h.register_hook(lambda g: g * 3)
        else:  # export traces this no_grad as plain ops
            with torch.autocast("cpu", enabled=False):
                with torch.no_grad():
                    q = h * 3
                h = h + q
        return nn.functional.mse_loss(h, y)


LOST = ["hook", "no_grad in autocast"]


def _lost(kind: str):
    torch.manual_seed(0)
    return LostBackward(kind), (torch.randn(4, 8), torch.randn(4, 8))


@pytest.mark.parametrize("kind", LOST)
def test_a_backward_export_loses_is_refused_naming_the_parameter(kind):
    module, inputs = _lost(kind)
    with pytest.raises(CaptureError) as err:
        mp.capture(module, inputs)
    msg = str(err.value)
    assert "\n" not in msg and "self_check=False" in msg
    assert "gradient of 'lin.weight'" in msg and "register_hook" in msg


@pytest.mark.parametrize("kind", LOST)
def test_without_the_gradient_check_those_captures_train_wrong(kind, monkeypatch):
    """What the check stands for: with it off (a planted bug), each of them
    is captured and trains away from eager PyTorch, with no other signal."""
    monkeypatch.setattr(capture_check, "_check_gradients", lambda *a: None)
    module, (x, y) = _lost(kind)
    strategy = mp.Strategy(global_batch_size=4, micro_batch_size=4)
    job = mp.plan(mp.capture(module, (x, y)), mp.Mesh(1, 1), strategy)
    hub, ranks = local_ranks(job, module, timeout_s=30)
    data = [(x.clone(), y.clone())] * 2
    run = train_local(job, hub, ranks, data, timeout_s=30)
    verdict, _ = against_eager(run.rank_losses, run.slices, module, data, 1,
                               OptimizerConfig.default("sgd"))
    assert not verdict["ok"] and any("lin.weight" in p for p in verdict["problems"])


def test_a_backward_that_fails_on_the_example_is_one_line(monkeypatch):
    """Planted: a backward kernel that raises (as an LSTM's did under the
    check's no_grad): one CaptureError line, not a traceback from the check."""
    real = rule_for

    def planted(k):
        rule = real(k)
        if k != "aten.threshold_backward.default":
            return rule

        def boom(*a, **kw):
            raise RuntimeError("Expected a proper Tensor but got None")
        return replace(rule, kernel=boom)

    monkeypatch.setattr("meshplan.runtime.codegen.rule_for", planted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(CaptureError, match=r"meshplan's backward of .* fails on the example: "
                       r"RuntimeError: Expected a proper Tensor but got None; this is a "
                       "meshplan bug"):
        mp.capture(model, (torch.randn(4, 4),), loss_fn=lambda out: out.pow(2).mean())
