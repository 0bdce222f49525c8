"""A `torch.autograd.Function` is kept whole (`capture/functions.py`): its
forward as the op `meshplan_fn::apply` (`ops/function_op.py`), and its own
backward for gradient,
so a straight-through estimator, a gradient reversal or a clipped
derivative trains as in eager PyTorch. torch.export alone keeps the forward
and drops the backward: the planted tests turn the keeping off and see the
self-check refuse, and with that off too, the training go wrong."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import meshplan.api as mp
from meshplan.autodiff import OptimizerConfig
from meshplan.capture import functions, torch_export
from meshplan.driver import capture_check
from meshplan.driver.compare import Bounds
from meshplan.driver.verify import against_eager
from meshplan.errors import CaptureError
from meshplan.ops import function_op
from meshplan.runtime.local import local_ranks, train_local
from tests.capture.functions_toy import Net, RoundSTE, batches

TIGHT = Bounds(loss_atol=1e-6, atol=1e-6, rtol=1e-6)
KINDS = ["straight-through", "reversal", "kinds", "interleaved"]


def _job(kind: str, dp: int = 1):
    torch.manual_seed(0)
    module = Net(kind)
    data = batches(3, 4 * dp)
    s = mp.Strategy(dp=dp, global_batch_size=4 * dp, micro_batch_size=2)
    graph = mp.capture(module, tuple(t[:2 * dp] for t in data[0]))
    return mp.plan(graph, mp.Mesh(1, dp), s), module, data


def _trains(job, module, data) -> dict:
    hub, ranks = local_ranks(job, module, timeout_s=30)
    run = train_local(job, hub, ranks, data, timeout_s=30)
    verdict, _ = against_eager(run.rank_losses, run.slices, module, data, 2,
                               OptimizerConfig.default("sgd"), bounds=TIGHT)
    return verdict


@pytest.mark.parametrize("kind", KINDS)
def test_a_function_trains_with_its_own_backward_as_in_eager(kind):
    job, module, data = _job(kind)
    assert function_op.KIND in {op.kind for op in job.graph.ops}
    assert "tests.capture.functions_toy" in job.graph.facts.op_modules
    verdict = _trains(job, module, data)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-6, verdict["problems"]
    assert verdict["params"]["fc1.weight"]["ok"]  # trained through the Function's backward


def test_a_function_whose_backward_cannot_run_is_traced_through():
    """Under no_grad, or on the data alone, no backward runs: its ops keep
    their splits, as export traces them."""
    job, module, data = _job("no backward")
    assert function_op.KIND not in {op.kind for op in job.graph.ops}
    assert "aten.round.default" in {op.kind for op in job.graph.ops}
    verdict = _trains(job, module, data)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-6, verdict["problems"]


def test_a_function_trains_as_in_eager_in_each_ranks_process():
    """dp2 on 2 gloo processes: each imports the Function's module by name."""
    job, module, data = _job("kinds", dp=2)
    result = mp.verify(job, module, data, bounds=TIGHT, timeout_s=60)
    assert result.ok, result.problems
    assert "w" in result.params


@pytest.mark.parametrize("kind", ["straight-through", "reversal"])
def test_traced_through_the_backward_is_lost_and_the_self_check_says_so(kind, monkeypatch):
    """Planted: without `kept_whole`, export traces the forward alone."""
    monkeypatch.setattr(torch_export, "kept_whole", nullcontext)
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="gradient of 'fc1.weight' through torch.export's "
                                           "program differs from its own backward"):
        mp.capture(Net(kind), batches(1, 4)[0])


def test_traced_through_and_unchecked_it_trains_wrong(monkeypatch):
    """Planted: neither kept whole nor self-checked, a straight-through
    estimator is differentiated as round (zero gradient): wrong, silently."""
    monkeypatch.setattr(torch_export, "kept_whole", nullcontext)
    monkeypatch.setattr(capture_check, "_check_gradients", lambda *a: None)
    verdict = _trains(*_job("straight-through"))
    assert not verdict["ok"] and any("fc1.weight" in p for p in verdict["problems"])


def test_a_function_defined_in_a_function_is_refused_in_one_line():
    class Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class Uses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            return Local.apply(self.fc(x)).sum()

    with pytest.raises(CaptureError, match=r"^torch.autograd.Function test_a_function_defined_"
                                           r".*Local is defined inside a function.*top level"):
        mp.capture(Uses(), (torch.randn(2, 3),))


@pytest.mark.parametrize("kind, says", [
    ("draws", r"Drawing draws random numbers \(aten.rand_like.default\).*draw them outside"),
    ("dirty", r"Dirty writes its inputs in place.*return a new tensor"),
])
def test_a_function_meshplan_cannot_rerun_is_refused_in_one_line(kind, says):
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match=says) as err:
        mp.capture(Net(kind), batches(1, 4)[0])
    assert "\n" not in str(err.value)


def test_an_argument_json_cannot_hold_is_refused_in_one_line():
    class Obj:
        pass

    with pytest.raises(CaptureError, match="RoundSTE takes or returns a Obj; .*tensors, numbers"):
        function_op.leaf(RoundSTE, Obj())


class _Ctx:
    """What a Function's forward asks of its ctx, for running it as plain ops."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass


def _own_and_derivative(cls, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of sum(f(x)) by the Function's own backward, and by
    torch's autograd of its forward's ops."""
    a = x.clone().requires_grad_()
    own = torch.autograd.grad(cls.apply(a).sum(), a)[0]
    b = x.clone().requires_grad_()
    return own, torch.autograd.grad(cls.forward(_Ctx(), b).sum(), b)[0]


def test_each_function_traced_through_has_its_forwards_derivative_for_backward():
    """`DERIVATIVE`'s entries (traced through, keeping their splits) really
    have the derivative of their forward as backward; RecurrentGemma's
    clipped derivative, which is not listed, fails the same comparison."""
    pytest.importorskip("transformers")
    x = torch.linspace(-6, 6, 2001)
    for path in functions.DERIVATIVE:
        own, derivative = _own_and_derivative(function_op.resolve_function(path), x)
        torch.testing.assert_close(own, derivative, rtol=1e-5, atol=1e-6, msg=path)
    clipped = function_op.resolve_function(
        "transformers.models.recurrent_gemma.modeling_recurrent_gemma:SqrtBoundDerivative")
    own, derivative = _own_and_derivative(clipped, torch.linspace(0, 1e-6, 101))
    assert not torch.allclose(own, derivative, rtol=1e-2)
