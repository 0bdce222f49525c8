"""The op rule record: everything meshplan knows about one op kind.

Invariants:
- One `OpRule` per kind, looked up with `rule_for(kind)` (see `table.py`).
- `infer` gives output metas only (None: run the kernel on meta tensors).
- `grad` emits backward ops through an `Emits`; it never runs kernels.
- `canonical` rewrites a captured op into the form the other fields describe
  (for example `layer_norm` into `native_layer_norm`, whose saved mean and
  rstd the gradient needs). It runs once, at capture.
- `temp_bytes` is physical: it is asked only at lowering, cached by signature.
- `category` is the one answer to "is this op a collective, an optimizer
  step, a transfer...": lowering, checking and reports ask it, never a list
  of kinds.
- This module imports nothing of `ops` that emits or infers (only the SBP
  signature types): gradient and canonical rules see the emitter as the
  `Emits` protocol, not as `ops.emit.Emitter`, whose inference asks the
  table that holds those rules. So `ops` imports in one direction:
  rule <- rules (grads_*, canonical, generic) <- table <- infer <- emit.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional, Protocol

from meshplan.ir import Arg, Op, Ref, TensorMeta
from meshplan.ir.choices import OpPrecision, OpRecompute
from meshplan.ops.sbp_sig import SbpRule


class Emits(Protocol):
    """What a rule may do with the emitter (`ops.emit.Emitter`): read a
    value's meta and add ops, their outputs inferred."""

    def meta(self, r: Ref) -> TensorMeta: ...

    def call(self, kind: str, *args: Arg, **kwargs: Arg) -> Ref: ...

    def call_multi(self, kind: str, *args: Arg, **kwargs: Arg) -> tuple[Ref, ...]: ...


class Category(Enum):
    """What an op is, for lowering: which stream runs it, and how."""

    COMPUTE = "compute"          # a kernel on this rank's tensors
    OPTIMIZER = "optimizer"      # a parameter update (batched by the executor)
    COLLECTIVE = "collective"    # boxing: communication along a mesh axis
    TRANSFER = "transfer"        # boxing: a value sent from one stage to another
    LOCAL_SLICE = "local_slice"  # boxing: a rank keeps its part, no communication

    @property
    def boxing(self) -> bool:
        """Inserted by the boxing pass to change a value's layout."""
        return self in (Category.COLLECTIVE, Category.TRANSFER, Category.LOCAL_SLICE)

    @property
    def communicates(self) -> bool:
        """Moves bytes between ranks."""
        return self in (Category.COLLECTIVE, Category.TRANSFER)


# grad(e, op, gouts, needs) -> [(input ref, gradient ref), ...]
Gouts = tuple[Optional[Ref], ...]  # one Ref (or None: zero gradient) per op output
Needs = Callable[[Ref], bool]  # whether that input wants a gradient
Grads = list[tuple[Ref, Ref]]
GradFn = Callable[[Emits, Op, Gouts, Needs], Grads]
# canonical(e, args, kwargs, ctx) -> the Refs standing for the captured node's
# outputs (capture's context `ctx`: no rewrite sees a mutation).
CanonicalFn = Callable[[Emits, tuple, dict, Any], tuple[Ref, ...]]
# infer(signature args, signature kwargs) -> output metas (see `ops/infer.py`)
InferFn = Callable[[tuple, dict], tuple[Optional[TensorMeta], ...]]


@dataclass(frozen=True, slots=True)
class OpRule:
    """Logical inference, kernel, category, gradient, temp bytes and cost of one op kind."""

    kind: str
    kernel: Callable
    category: Category = Category.COMPUTE
    grad: Optional[GradFn] = None
    infer: Optional[InferFn] = None
    canonical: Optional[CanonicalFn] = None
    flops: Optional[Callable[[tuple], float]] = None     # (arg signature) -> flops
    temp_bytes: Optional[Callable[[tuple], int]] = None  # (arg signature) -> bytes
    exact: bool = True
    differentiable: bool = True
    # The outputs a gradient flows back through (None: every float output).
    # nll_loss's total_weight is a count: a gradient for it would be dead code.
    grad_outputs: Optional[tuple[int, ...]] = None
    # Kernel over lists: one list per tensor argument, the literal kwargs
    # shared; returns one list per output. Lets the executor run a run of
    # such ops (one per parameter) as a single call.
    batched: Optional[Callable] = None
    # `batched` also takes `fused=True`: torch's fused kernel for it (one
    # vectorized pass over all the lists: `torch._fused_adamw_`). With
    # `--kernels inductor` a group of such ops calls that, never inside an
    # Inductor graph: as fast as Inductor's code for the same update, with
    # nothing to build (docs/concepts/kernels.md).
    fused_batched: bool = False
    # (the group's argument signatures, the shared kwargs, device type) ->
    # the bytes one `batched` call allocates beyond its arguments, at most:
    # the workspace of a group of such ops in the memory plan.
    batched_temp: Optional[Callable[[list, dict, str], int]] = None
    # SBP signatures along one mesh axis (see `sbp_sig.py`); default: replicated.
    sbp: Optional[SbpRule] = None
    # The op sums its inputs (a gradient's contributions): a Replicate input may
    # become its Partial share in place (`local_partial`), so Partial inputs
    # stay Partial and are reduced once, after the sum (`passes/propagate.py`).
    sums: bool = False
    # (argument position, output index): the argument is a shape that must
    # equal that output's shape; lowering puts the rank's local shape there.
    shape_args: tuple[tuple[int, int], ...] = ()
    # Mixed precision: compute in bf16/fp16, in fp32, or follow type
    # promotion; see `ops/policy.py`.
    precision: OpPrecision = OpPrecision.PROMOTE
    # Selective recompute: keep the output, cannot be replayed, or recompute
    # freely.
    recompute: OpRecompute = OpRecompute.FREE
    # Physical kernels per device type: ((device type, chooser(op, values) ->
    # kernel name), ...); a device not listed runs `kernel` itself. Asked only
    # at lowering (see `ops/device_kernels.py`).
    devices: tuple[tuple[str, Callable[[Op, Any], str]], ...] = ()
    # Writes a tensor in place: its schema says so (`add_`, `copy_`), or its
    # CompositeImplicit form updates buffers unannounced (`batch_norm`'s running
    # stats). Capture hands a program with such an op to torch's functionalization.
    mutates: bool = False
    # Returns a list of tensors (`Tensor[]`), even of one: bound by unpacking.
    returns_list: bool = False
    # Its output shapes follow the values (rows per expert counted at run
    # time): it runs as its own call, never inside an Inductor graph.
    data_shapes: bool = False

    @property
    def fuses(self) -> bool:
        """Whether Inductor can fuse it into a kernel with its neighbours: not
        a view (torch's schema says so) and not a library kernel (a matmul,
        attention, a convolution: the ops priced by their `flops`), which a
        compiled graph calls as it is (`runtime/codegen.py` builds a run only
        with two or more such ops)."""
        return self.flops is None and not getattr(self.kernel, "is_view", False)
