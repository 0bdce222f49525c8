"""The optimizer's kernels with `fused=True` (`--kernels inductor`): torch's
fused kernel, equal to the per-tensor loop `torch.optim` runs on a CPU
within rounding, for any strides: on CPU that kernel reads a non-dense
tensor wrongly, silently, so `kernels.by_kernel` hands it dense ones only."""

from __future__ import annotations

import pytest
import torch

from meshplan.ops import kernels

HP = {"adamw": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
      "sgd": dict(lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.0, nesterov=False)}


def _tensors(seed: int):
    """Parameters and gradients of every stride the plan may hand over: a
    dense one, a transposed parameter, an expanded gradient (a sum's
    backward), two parameters adopting the very same gradient tensor."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(6, 5, generator=g), torch.randn(5, 6, generator=g).t(),
              torch.randn(4, 3, generator=g), torch.randn(7, generator=g),
              torch.randn(7, generator=g)]
    shared = torch.randn(7, generator=g)
    grads = [torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g),
             torch.randn(1, 1, generator=g).expand(4, 3), shared, shared]
    return params, grads


def _step(kind: str, params, grads, state, fused: bool, coef=None):
    if kind == "adamw":
        m, v, s = state
        return kernels.adamw_multi(params, grads, m, v, s, fused=fused, coef=coef, **HP[kind])
    return kernels.sgd_multi(params, grads, state[0], fused=fused, coef=coef, **HP[kind])


def _state(kind: str, params):
    if kind == "adamw":
        return ([torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params],
                [torch.tensor(0.0) for _ in params])
    return ([None] * len(params),)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("clip", [False, True])
def test_the_fused_kernel_equals_the_loop_for_any_strides(kind, clip):
    params, _ = _tensors(0)
    loop, fused = [p.clone() for p in params], [p.clone() for p in params]
    fused[1] = fused[1].t().contiguous().t()  # transposed, as the original
    loop_state, fused_state = _state(kind, params), _state(kind, params)
    coef = torch.tensor(0.37) if clip else None
    for k in range(3):
        _, grads = _tensors(k + 1)
        out_loop = _step(kind, loop, grads, loop_state, False, coef)
        out_fused = _step(kind, fused, grads, fused_state, True, coef)
        loop_state, fused_state = out_loop[1:], out_fused[1:]
        for a, b in zip(grads, _tensors(k + 1)[1]):
            assert torch.equal(a, b)  # no gradient written to
    for a, b in zip(loop, fused):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    for xs, ys in zip(loop_state, fused_state):
        for a, b in zip(xs, ys):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_a_non_dense_tensor_given_to_the_fused_kernel_is_caught(monkeypatch):
    """Planted: every tensor handed to torch's fused kernel as it is."""
    def unchecked(step, lists, fused):
        step(*lists, fused)

    monkeypatch.setattr(kernels, "by_kernel", unchecked)
    with pytest.raises(AssertionError):
        test_the_fused_kernel_equals_the_loop_for_any_strides("adamw", False)
