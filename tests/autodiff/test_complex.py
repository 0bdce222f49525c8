"""A gradient flows through complex values: an FFT mixing layer (FNet's)
trains equal to eager. Before, the complex output was left out of the
values needing a gradient, which cut the gradient of every layer below it
silently (the loss of step 0 agreed; step 1's did not)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshplan.api as mp
from meshplan.errors import CaptureError


class FourierMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x, y):
        h = torch.fft.fftn(self.inp(x), dim=(1, 2)).real
        return nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def test_an_fft_layer_trains_as_eager():
    torch.manual_seed(0)
    model = FourierMix()
    batches = [(torch.randn(4, 6, 8), torch.randn(4, 6)) for _ in range(3)]
    graph = mp.capture(model, batches[0])
    job = mp.plan(graph, mp.Mesh(1, 1), mp.Strategy(global_batch_size=4, micro_batch_size=4))
    r = mp.verify(job, model, batches)
    assert r["ok"], r["problems"]
    assert r["params"]["inp.weight"]["max_abs"] <= 1e-6  # the layer below the FFT trains


class ComplexRotary(nn.Module):
    """llama4's rotary embedding: pairs of features as complex numbers,
    turned by a product with complex frequencies."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.register_buffer("freqs", torch.polar(torch.ones(6, 4), torch.rand(6, 4) * 3))

    def forward(self, x, y):
        h = self.inp(x)
        turned = torch.view_as_complex(h.reshape(*h.shape[:-1], 4, 2)) * self.freqs
        return nn.functional.mse_loss(self.out(torch.view_as_real(turned).flatten(2))
                                      .squeeze(-1), y)


def _rotary():
    torch.manual_seed(0)
    return ComplexRotary(), [(torch.randn(4, 6, 8), torch.randn(4, 6)) for _ in range(3)]


def test_a_complex_rotary_product_trains_as_eager():
    """The hand-written rule of mul (g * b) is for real tensors; on complex
    ones torch's (g * conj(b)) is used. With the real rule, llama4 trained
    wrong silently: its embeddings' update 38% off eager's."""
    model, batches = _rotary()
    job = mp.plan(mp.capture(model, batches[0]), mp.Mesh(1, 1),
                  mp.Strategy(global_batch_size=4, micro_batch_size=4))
    r = mp.verify(job, model, batches)
    assert r["ok"], r["problems"]
    assert r["params"]["inp.weight"]["max_abs"] <= 1e-6


@pytest.fixture
def real_rule_on_complex(monkeypatch):
    """Planted: the hand-written rules run on complex tensors too."""
    from meshplan.ops import table

    monkeypatch.setattr(table, "_real_only", lambda grad, e, op, gouts, needs:
                        grad(e, op, gouts, needs))
    table.rule_for.cache_clear()
    yield
    table.rule_for.cache_clear()


def test_the_capture_check_refuses_a_wrong_gradient_rule(real_rule_on_complex):
    model, batches = _rotary()
    with pytest.raises(CaptureError, match="meshplan's gradient of 'inp.weight' differs from "
                       "ComplexRotary's own backward"):
        mp.capture(model, batches[0])
    # unchecked, the same capture trains wrong: what the check stands between
    graph = mp.capture(model, batches[0], self_check=False)
    job = mp.plan(graph, mp.Mesh(1, 1), mp.Strategy(global_batch_size=4, micro_batch_size=4))
    assert not mp.verify(job, model, batches)["ok"]


def test_the_verdict_sees_a_complex_tensor_s_imaginary_part():
    """A complex buffer differing only in its imaginary part is judged by
    the distance in the plane (a cast to double, before, dropped it)."""
    from meshplan.driver.compare import BOUNDS, tensor_diff
    from meshplan.ir.choices import Precision

    ref = torch.polar(torch.ones(6), torch.arange(6.0))
    off = ref + 0.5j
    d = tensor_diff(off, ref, BOUNDS[Precision.FP32])
    assert not d["ok"] and abs(d["max_abs"] - 0.5) < 1e-6
    assert tensor_diff(ref.clone(), ref, BOUNDS[Precision.FP32])["ok"]


def test_the_capture_check_refuses_a_gradient_autodiff_cut(monkeypatch):
    """Planted: the FFT's complex output left out of the values that need a
    gradient (the bug FourierMix once trained with): no gradient reaches
    `inp.weight`, which the module's own backward moves."""
    from meshplan.autodiff import backward

    keep = backward._requires_grad
    monkeypatch.setattr(backward, "_requires_grad", lambda graph: {
        v for v in keep(graph) if not graph.values[v].meta.dtype.torch.is_complex})
    torch.manual_seed(0)
    model = FourierMix()
    with pytest.raises(CaptureError, match="meshplan's gradient of 'inp.weight' differs"):
        mp.capture(model, (torch.randn(4, 6, 8), torch.randn(4, 6)))
