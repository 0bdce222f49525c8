"""The generic rule: any aten op, or custom op with a fake kernel and an
autograd formula (`ops/resolve.py`), with its gradient through
`torch.func.vjp` (a custom op's: through `torch.autograd.grad`).

Invariant: a `meshplan.vjp` op recomputes its forward op from the saved
inputs and differentiates it with `torch.func.vjp`. It is correct for every
differentiable aten op, at the price of one extra forward.
Its args are `(fwd_kind, fwd_args, fwd_kwargs, gouts, wrt)` where `wrt`
indexes the forward op's tensor arguments in traversal order.

Its SBP signatures (`vjp_sbp`), for a forward kind `sbp_table.splits_its_vjp`, are the
forward's own splits: where the forward computes each output shard from
its inputs' shards (no Partial output), the vjp of a shard gives the
gradient of each split input's shard, and of a replicated (broadcast)
input that shard's share of its gradient: Partial. Other kinds: replicated.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from meshplan.ir import Op, Ref, TensorMeta
from meshplan.ir.kinds import VJP
from meshplan.ir.sbp import Partial, Replicate, Shard
from meshplan.ops.resolve import is_custom, resolve_op
from meshplan.ops.rule import Emits, Gouts, Grads, Needs
from meshplan.ops.sbp_sig import Outs, SbpRule, SbpSig, replicated, tensors
from meshplan.ops.sbp_table import splits_its_vjp


def _tensor_slots(op: Op) -> list[Ref]:
    return [Ref(r) for r in op.refs()]


def vjp_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    """Emit one `meshplan.vjp` op computing every needed input gradient."""
    slots = _tensor_slots(op)
    wrt = tuple(i for i, r in enumerate(slots) if needs(r))
    if not wrt:
        return []
    outs = e.call_multi(
        VJP, op.kind, op.args, op.kwargs, tuple(gouts), wrt
    )
    return [(slots[i], g) for i, g in zip(wrt, outs)]


def vjp_sbp(sbp_of: Callable[[str], SbpRule], args: tuple, kwargs: dict, outs: Outs,
            n: int) -> list[SbpSig]:
    """The vjp's signatures, from its forward op's (`sbp_of(kind)`, the rule
    table's; see the module docstring)."""
    kind, fwd_args, fwd_kwargs, gouts, wrt = args
    n_in = len(tensors((args, kwargs)))
    if not splits_its_vjp(kind):
        return [replicated(n_in, len(outs))]
    fwd_outs = tuple(g if isinstance(g, TensorMeta) else None for g in gouts)
    sigs = []
    for sig in sbp_of(kind)(fwd_args, dict(fwd_kwargs), fwd_outs, n):
        if sig.variant or not all(isinstance(o, Shard) for o in sig.outs if o is not None):
            continue
        grads = tuple(Partial() if isinstance(sig.ins[i], Replicate) else sig.ins[i]
                      for i in wrt)
        gout_ins = tuple(o for o, g in zip(sig.outs, gouts) if isinstance(g, TensorMeta)
                         and o is not None)
        sigs.append(SbpSig(sig.ins + gout_ins, grads))
    return sigs + [replicated(n_in, len(outs))]


def vjp_infer(sig_args: tuple, sig_kwargs: dict) -> tuple[TensorMeta, ...]:
    _kind, fwd_args, fwd_kwargs, _gouts, wrt = sig_args
    metas: list[TensorMeta] = []
    _collect(fwd_args, metas)
    _collect(fwd_kwargs, metas)
    return tuple(metas[i] for i in wrt)


def _collect(sig: Any, out: list[TensorMeta]) -> None:
    if isinstance(sig, TensorMeta):
        out.append(sig)
    elif isinstance(sig, (tuple, list)):
        for x in sig:
            _collect(x, out)


def _substitute(structure: Any, tensors: dict[int, torch.Tensor], counter: list[int]) -> Any:
    """Rebuild `structure`, replacing the k-th tensor by `tensors[k]` if given."""
    if isinstance(structure, torch.Tensor):
        k = counter[0]
        counter[0] += 1
        return tensors.get(k, structure)
    if isinstance(structure, (tuple, list)):
        return type(structure)(_substitute(x, tensors, counter) for x in structure)
    return structure


def vjp_kernel(fwd_kind: str, fwd_args: tuple, fwd_kwargs: tuple, gouts: tuple,
               wrt: tuple[int, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Run the forward under `torch.func.vjp` and pull back `gouts`."""
    fn = resolve_op(fwd_kind)
    kw_names = [k for k, _ in fwd_kwargs]
    flat: list[torch.Tensor] = []
    _flatten(fwd_args, flat)
    _flatten([v for _, v in fwd_kwargs], flat)
    primals = [flat[i] for i in wrt]

    def f(*ps: torch.Tensor) -> Any:
        subs = dict(zip(wrt, ps))
        counter = [0]
        args = _substitute(list(fwd_args), subs, counter)
        kwargs = _substitute([v for _, v in fwd_kwargs], subs, counter)
        return fn(*args, **dict(zip(kw_names, kwargs)))

    if not is_custom(fwd_kind):
        kept: list[int] = []  # the outputs that carry gradients (topk's indices do not)

        def differentiable_outputs(*ps: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = f(*ps)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            kept[:] = [i for i, o in enumerate(outs) if _carries_grad(o)]
            return tuple(outs[i] for i in kept)

        # grad mode on whatever the caller's: an op that saves for backward only
        # when it is (LSTM's workspace) left it undefined under no_grad
        with torch.enable_grad():
            outs, pullback = torch.func.vjp(differentiable_outputs, *primals)  # type: ignore[misc]
        grads = pullback(tuple(gouts[i] if gouts[i] is not None else torch.zeros_like(o)
                               for i, o in zip(kept, outs)))
    else:
        grads = _autograd_vjp(f, primals, gouts)
    # A one-output op's kernel returns the tensor itself (codegen binds it whole).
    return grads[0] if len(grads) == 1 else tuple(grads)


def _carries_grad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _autograd_vjp(f: Callable, primals: list[torch.Tensor],
                  gouts: tuple) -> tuple[torch.Tensor, ...]:
    """`torch.func.vjp`'s answer through torch.autograd, for a custom op
    whose autograd formula torch.func cannot run (an autograd.Function
    without functorch support, as `torch.library.register_autograd` makes)."""
    leaves = [p.detach().requires_grad_() for p in primals]
    with torch.enable_grad():
        out = f(*leaves)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    pairs = [(o, g if g is not None else torch.zeros_like(o))
             for o, g in zip(outs, gouts) if _carries_grad(o) and o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                                allow_unused=True) if pairs else (None,) * len(leaves)
    return tuple(g if g is not None else torch.zeros_like(p) for g, p in zip(grads, leaves))


def _flatten(structure: Any, out: list[torch.Tensor]) -> None:
    if isinstance(structure, torch.Tensor):
        out.append(structure)
    elif isinstance(structure, (tuple, list)):
        for x in structure:
            _flatten(x, out)
