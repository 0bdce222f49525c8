"""Kernels of meshplan's own ops (those with no single aten op).

Invariants:
- The optimizer kernels update state in place and return it: their outputs
  alias their state inputs.
- The optimizer kernels call torch's own functional optimizers, so the
  arithmetic is the same as `torch.optim.SGD` / `torch.optim.AdamW`, with
  torch's own choice of implementation per device (`foreach=None`: the
  per-tensor loop on CPU, the multi-tensor kernels on CUDA). Their
  `*_multi` forms take one list per argument; the executor batches a run of
  optimizer ops into one such call, as `torch.optim` itself does. With
  `fused=True` (`--kernels inductor`: `OpRule.fused_batched`) they call
  torch's fused kernel (`torch._fused_adamw_`: one vectorized pass over all
  the lists), on the parameters whose tensors are dense: on CPU that kernel
  reads a transposed or expanded tensor wrongly, silently (measured: nan for
  an expanded gradient), so a parameter with any tensor not dense takes the
  per-tensor loop.
- What a batched call allocates beyond its arguments (`*_temp`, the memory
  plan's workspace of a group: `OpRule.batched_temp`), measured with the
  CPU allocator's events: the clipped gradients, all of the group's at once;
  torch's per-tensor loop one or two tensors of a parameter's size at a
  time (AdamW's with the previous parameter's denominator); its
  multi-tensor kernels (CUDA) one for every parameter of the group at once;
  the fused kernel nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _adamw
from torch.optim.sgd import sgd as _sgd


def grad_sum(*grads: torch.Tensor) -> torch.Tensor:
    """Sum of the gradient contributions of a value with several consumers."""
    acc = grads[0] + grads[1]
    for g in grads[2:]:
        acc.add_(g)
    return acc


def accumulate_grad(acc: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    """Add one micro-batch's gradient into the step's accumulator.

    The first micro-batch adopts `g` (no zero-fill, no copy), as autograd
    does for `.grad`. An adopted `g` may be an expanded view, or the very
    tensor another parameter adopted, so it is never written to: the second
    micro-batch adds out of place into a fresh tensor the accumulator owns
    (marked), and later ones add into that in place."""
    if acc is None:
        return g
    if getattr(acc, OWNED, False):
        return acc.add_(g)
    return own(acc + g)


OWNED = "_meshplan_owned"  # the mark of an accumulator the step owns (`accumulate_grad`)


def own(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` as an accumulator the step owns: later gradients add into it."""
    setattr(t, OWNED, True)
    return t


def sgd_multi(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None], *,
              lr: float | Tensor, momentum: float, weight_decay: float, dampening: float,
              nesterov: bool, coef: Tensor | None = None, fused: bool = False,
              ) -> tuple[list[Tensor], list[Tensor | None]]:
    """`torch.optim.SGD` steps on lists of parameters (each gradient first
    times the clipping factor `coef`, if given; `lr` a float, or the
    schedule's state tensor; `fused`: torch's fused kernel); returns
    (params, bufs)."""
    bufs, grads = list(bufs), clipped(grads, coef)

    def step(ps, gs, bs, fuse):
        _sgd(ps, gs, bs, weight_decay=weight_decay, momentum=momentum, lr=float(lr),
             dampening=dampening, nesterov=nesterov, maximize=False, foreach=None,
             fused=fuse or None)

    with torch.no_grad():
        by_kernel(step, [params, grads, bufs], fused)
    return params, bufs


def sgd_step(param: Tensor, grad: Tensor, buf: Tensor | None,
             **hp: Any) -> tuple[Tensor, Tensor | None]:
    """One SGD step on one parameter; returns (param, buf)."""
    (p,), (b,) = sgd_multi([param], [grad], [buf], **hp)
    return p, b


def adamw_multi(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                exp_avg_sqs: list[Tensor], steps: list[Tensor], *, lr: float | Tensor,
                beta1: float, beta2: float, eps: float, weight_decay: float,
                coef: Tensor | None = None, fused: bool = False) -> tuple[list[Tensor], ...]:
    """`torch.optim.AdamW` steps on lists of parameters (each gradient first
    times the clipping factor `coef`, if given; `lr` a float, or the
    schedule's state tensor; `fused`: torch's fused kernel); returns the new
    state lists."""
    grads = clipped(grads, coef)

    def step(ps, gs, ms, vs, ss, fuse):
        # a step count on the host (CUDA: `runtime/state.py`) is not the fused kernel's
        fuse = fuse and all(x.device == ps[0].device for x in ss)
        _adamw(ps, gs, ms, vs, [], ss, foreach=None, capturable=False, differentiable=False,
               fused=fuse or None, grad_scale=None, found_inf=None, has_complex=False,
               amsgrad=False, beta1=beta1, beta2=beta2, lr=float(lr),
               weight_decay=weight_decay, eps=eps, maximize=False)

    with torch.no_grad():
        by_kernel(step, [params, grads, exp_avgs, exp_avg_sqs, steps], fused)
    return params, exp_avgs, exp_avg_sqs, steps


def by_kernel(step: Callable, lists: list[list], fused: bool) -> None:
    """`step(*lists, fuse)`, torch's functional optimizer: with `fused`, its
    fused kernel on the parameters whose tensors are all dense, the
    per-tensor loop on the others (a copy made dense would be workspace the
    memory plan does not hold); lists of state written back (a first step's
    new momentum buffers)."""
    if not fused:
        step(*lists, False)
        return
    dense = [all(x[i] is None or x[i].is_contiguous() for x in lists)
             for i in range(len(lists[0]))]
    for fuse in (True, False):
        picked = [i for i, d in enumerate(dense) if d == fuse]
        if picked:
            part = [[x[i] for i in picked] for x in lists]
            step(*part, fuse)
            for x, y in zip(lists, part):  # a first step's new momentum buffers
                for i, t in zip(picked, y):
                    x[i] = t


def adamw_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
               step: Tensor, **hp: Any) -> tuple[Tensor, ...]:
    """One AdamW step on one parameter; returns its new state."""
    out = adamw_multi([param], [grad], [exp_avg], [exp_avg_sq], [step], **hp)
    return tuple(x[0] for x in out)


def sgd_temp(sigs: list[tuple], kwargs: dict, device: str) -> int:
    """Bytes one `sgd_multi` call over ops of argument signatures `sigs`
    (param, grad, buf) allocates beyond them, at most, on `device`: the
    clipped gradients, and torch's weight-decayed gradients
    (`grad.add(param)`)."""
    own = _torch_temp([s[0].nbytes for s in sigs], 1, device) if kwargs["weight_decay"] else 0
    return _clip_temp(sigs, kwargs) + own


def adamw_temp(sigs: list[tuple], kwargs: dict, device: str) -> int:
    """Bytes one `adamw_multi` call over ops of argument signatures `sigs`
    (param, grad, exp_avg, exp_avg_sq, step) allocates beyond them, at most,
    on `device`: the clipped gradients, and torch's denominators (the loop's
    `denom = exp_avg_sq.sqrt() / bias_correction2_sqrt`: two tensors while
    the last parameter's `denom` lives; the multi-tensor kernels'
    `_foreach_sqrt`, one per parameter)."""
    return _clip_temp(sigs, kwargs) + _torch_temp([s[3].nbytes for s in sigs], 2, device,
                                                  held=1)


def _torch_temp(sizes: list[int], loop: int, device: str, held: int = 0) -> int:
    """Temporaries of torch's functional optimizer: in its per-tensor loop
    (CPU's default, and the fused path's fallback) `loop` tensors of a
    parameter's size, `held` of the parameter before it still alive; in its
    multi-tensor kernels (the default elsewhere) one per parameter, all at
    once; its fused kernel makes none."""
    first, *rest = sorted(sizes, reverse=True)
    one_at_a_time = loop * first + held * (rest[0] if rest else 0)
    return one_at_a_time if device == "cpu" else max(one_at_a_time, sum(sizes))


def _clip_temp(sigs: list[tuple], kwargs: dict) -> int:
    """The clipped gradients, all made before the update (`clipped`)."""
    return sum(s[1].nbytes for s in sigs) if kwargs.get("coef") is not None else 0


def clipped(grads: list[Tensor], coef: Tensor | None) -> list[Tensor]:
    """Each gradient times the clipping factor, as `clip_grad_norm_` scales
    `.grad` (always, a factor of 1 included). Out of place: an accumulator
    may be a tensor another parameter adopted (`accumulate_grad`)."""
    if coef is None:
        return grads
    return [g * coef for g in grads]


def grad_sq(param: Tensor, grad: Tensor, *slots: Tensor, counted: bool = True) -> Tensor:
    """A gradient's (local piece's) squared 2-norm, in float32; it reads the
    optimizer's tensors so that its layout is the optimizer's (ops/sbp_nn.py).
    `counted=False`: a tied weight's copy, counted on another stage: zero."""
    if not counted:
        return grad.new_zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(grad.to(torch.promote_types(grad.dtype, torch.float32))) ** 2


def grad_sq_temp(sig: tuple) -> int:
    """`grad_sq`'s workspace: a gradient narrower than float32, cast to it."""
    grad = sig[1]
    return grad.numel * 4 if grad.dtype.itemsize < 4 else 0


def sq_sum(*squares: Tensor, device: torch.device | None = None) -> Tensor:
    """The sum of gradients' squared norms (none: zero, on `device`)."""
    if not squares:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(squares).sum() if len(squares) > 1 else squares[0]


def clip_coef(total_sq: Tensor, max_norm: float) -> tuple[Tensor, Tensor]:
    """(the global norm, the factor every gradient takes): torch's
    `clip_grad_norm_`, `min(1, max_norm / (norm + 1e-6))`."""
    norm = total_sq.sqrt()
    return norm, torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def boxing_identity(x: Tensor, **_layout: Any) -> Tensor:
    """A boxing op on the logical (single-process) tensor: the identity.
    Its distributed kernels live in the runtime, chosen by lowering."""
    return x
