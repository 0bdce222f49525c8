"""The optimizer's kernels with `fused=True` (`--kernels inductor`): torch's
fused kernel, equal to the per-tensor loop `torch.optim` runs on a CPU
within rounding, for any strides: on CPU that kernel reads a non-dense
tensor wrongly, silently, so `kernels.by_kernel` hands it dense ones only."""

from __future__ import annotations

import pytest
import torch

from meshplan.ir import DType, TensorMeta, kinds
from meshplan.ops import kernels
from meshplan.ops.table import rule_for
from tests.allocator import peak_of

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


def _meta(t: torch.Tensor):
    return TensorMeta(tuple(t.shape), DType(str(t.dtype).removeprefix("torch.")))


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batched_update_allocates_at_most_its_planned_workspace(kind, fused, clip, seed):
    """The memory plan's workspace of a group of updates (`OpRule.batched_temp`
    on cpu) bounds what the call allocates, measured by the CPU allocator,
    for any sizes and strides; and the per-tensor loop on one parameter
    reaches it (nothing counted that it does not allocate)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 20000, (seed + 1,), generator=g).tolist()
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g) for n in sizes]
    grads[0] = torch.randn(1, generator=g).expand(sizes[0])  # a sum's backward: not dense
    state = _state(kind, params)
    if kind == "sgd":  # the buffers of a step after the first (the first makes them: state)
        state = ([torch.zeros_like(p) for p in params],)
    coef = torch.tensor(0.37) if clip else None
    hp = HP[kind] | ({"coef": coef} if clip else {})
    sigs = [(_meta(p), _meta(gr)) + tuple(_meta(x[i]) for x in state)
            for i, (p, gr) in enumerate(zip(params, grads))]
    planned = rule_for(kinds.ADAMW if kind == "adamw" else kinds.SGD).batched_temp(sigs, hp, "cpu")
    measured = peak_of(lambda: _step(kind, params, grads, state, fused, coef))
    assert measured <= planned + 64, (measured, planned)  # + a few scalars (lr, steps)
    if not fused and len(sizes) == 1:
        assert measured >= planned, (measured, planned)


def test_a_workspace_that_misses_the_clipped_gradients_is_caught(monkeypatch):
    """Planted: the clipped gradients counted nowhere."""
    monkeypatch.setattr(kernels, "_clip_temp", lambda sigs, kwargs: 0)
    with pytest.raises(AssertionError):
        test_a_batched_update_allocates_at_most_its_planned_workspace("adamw", False, True, 2)


def test_a_loop_workspace_that_misses_the_last_denominator_is_caught(monkeypatch):
    """Planted: AdamW's loop counted without the previous parameter's `denom`."""
    loop = kernels._torch_temp
    monkeypatch.setattr(kernels, "_torch_temp", lambda *a, held=0: loop(*a))
    with pytest.raises(AssertionError):
        test_a_batched_update_allocates_at_most_its_planned_workspace("adamw", False, False, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gradients_norm_allocates_at_most_its_workspace(dtype):
    """`grad_sq` casts a gradient narrower than float32 (its rule's temp
    bytes count that); a float32 one it reads as it is."""
    grad = torch.randn(3000, dtype=dtype)
    planned = rule_for(kinds.GRAD_SQ).temp_bytes((_meta(grad), _meta(grad)))
    measured = peak_of(lambda: kernels.grad_sq(grad, grad))
    assert planned <= measured <= planned + 64, (measured, planned)
