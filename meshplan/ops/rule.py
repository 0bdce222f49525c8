"""The op rule record: everything meshplan knows about one op kind.

Invariants:
- One `OpRule` per kind, looked up with `rule_for(kind)` (see `table.py`).
- `infer` gives output metas only (None: run the kernel on meta tensors).
- `grad` emits backward ops through an `Emitter`; it never runs kernels.
- `canonical` rewrites a captured op into the form the other fields describe
  (for example `layer_norm` into `native_layer_norm`, whose saved mean and
  rstd the gradient needs). It runs once, at capture.
- `temp_bytes` is physical: it is asked only at lowering, cached by signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from meshplan.ir import Op, Ref

if TYPE_CHECKING:
    from meshplan.ops.emit import Emitter

# grad(e, op, gouts, needs) -> [(input ref, gradient ref), ...]
#   gouts: one Ref (or None: zero gradient) per op output
#   needs(ref): whether that input wants a gradient
GradFn = Callable[["Emitter", Op, tuple[Optional[Ref], ...], Callable[[Ref], bool]], list]
# canonical(e, args, kwargs) -> the Refs standing for the captured node's outputs
CanonicalFn = Callable[["Emitter", tuple, dict], tuple]


@dataclass(frozen=True, slots=True)
class OpRule:
    """Logical inference, kernel, gradient, temp bytes and cost of one op kind."""

    kind: str
    kernel: Callable
    grad: Optional[GradFn] = None
    infer: Optional[Callable] = None
    canonical: Optional[CanonicalFn] = None
    flops: Optional[Callable] = None       # (arg signature) -> float
    temp_bytes: Optional[Callable] = None  # (arg signature) -> int
    exact: bool = True
    differentiable: bool = True
    # Kernel over lists: one list per tensor argument, the literal kwargs
    # shared; returns one list per output. Lets the executor run a run of
    # such ops (one per parameter) as a single call.
    batched: Optional[Callable] = None
    # SBP signatures along one mesh axis (see `sbp_sig.py`); default: replicated.
    sbp: Optional[Callable] = None
    # (argument position, output index): the argument is a shape that must
    # equal that output's shape; lowering puts the rank's local shape there.
    shape_args: tuple[tuple[int, int], ...] = ()
    # Mixed precision: "low" (compute in bf16/fp16), "fp32", or "" (follow
    # type promotion); see `ops/policy.py`.
    precision: str = ""
    # Selective recompute: "keep" (keep the output), "random" (cannot be
    # replayed), or "" (recompute freely).
    recompute: str = ""
    # Physical kernels per device type: ((device type, chooser(op, values) ->
    # kernel name), ...); a device not listed runs `kernel` itself. Asked only
    # at lowering (see `ops/device_kernels.py`).
    devices: tuple = ()
