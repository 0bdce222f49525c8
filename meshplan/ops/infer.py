"""Logical output inference: shapes and dtypes of an op's outputs.

Invariants:
- Outputs only. Nothing here computes kernel workspace sizes; those belong to
  physical lowering (`ops.temp`).
- Inference runs the aten op on `meta` tensors, so every aten op torch knows
  is covered by torch's own shape functions, and the answer is cached by
  signature (kind + argument metas + literals): a layer repeated 96 times is
  inferred once.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Callable, Optional

import torch

from meshplan.errors import CaptureError
from meshplan.ir import DEVICE, DType, Ref, TensorMeta
from meshplan.ops.table import rule_for

Metas = tuple[Optional[TensorMeta], ...]  # an op's output metas (None: an absent output)


class InferStats:
    """Counts logical inference calls and cache hits (reported by `compile`)."""

    calls = 0
    misses = 0

    @classmethod
    def snapshot(cls) -> dict[str, int]:
        return {"calls": cls.calls, "cache_hits": cls.calls - cls.misses}


def to_sig(a: Any, meta_of: Callable[[int], TensorMeta]) -> Any:
    """Replace each `Ref` by its `TensorMeta`, giving a hashable signature."""
    t = type(a)
    if t is tuple:  # the hot path: flat argument tuples (exact type checks are cheaper)
        return tuple(meta_of(x.id) if type(x) is Ref else
                     (to_sig(x, meta_of) if type(x) is tuple else x) for x in a)
    if t is Ref:
        return meta_of(a.id)
    return a


def materialize(sig: Any, device: str = "meta") -> Any:
    """Turn a signature back into call arguments, with tensors on `device`."""
    if isinstance(sig, TensorMeta):
        return torch.empty(sig.shape, dtype=sig.dtype.torch, device=device)
    if isinstance(sig, DType):
        return sig.torch
    if isinstance(sig, str) and sig == DEVICE:  # made where it runs: here, `device`
        return torch.device(device)
    if isinstance(sig, tuple):
        return [materialize(x, device) for x in sig]
    return sig


def infer_outputs(kind: str, args: tuple, kwargs: tuple,
                  meta_of: Callable[[int], TensorMeta]) -> Metas:
    """Output metas of `kind` applied to `args`/`kwargs` (Refs resolved by `meta_of`)."""
    InferStats.calls += 1
    return _infer_cached(kind, to_sig(args, meta_of), to_sig(kwargs, meta_of))


@cache
def _infer_cached(kind: str, sig_args: tuple, sig_kwargs: tuple) -> Metas:
    InferStats.misses += 1
    rule = rule_for(kind)
    if rule.infer is not None:
        return rule.infer(sig_args, dict(sig_kwargs))
    call_args = [materialize(a) for a in sig_args]
    call_kwargs = {k: materialize(v) for k, v in sig_kwargs}
    try:
        out = rule.kernel(*call_args, **call_kwargs)
    except Exception as e:  # torch raises many kinds here
        raise CaptureError(
            f"no shape rule for {kind}: its meta kernel failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); this op cannot be planned"
        ) from e
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(None if t is None else TensorMeta.of(t) for t in outs)
