"""The logical graph: frozen, typed, SSA.

Invariants:
- A `Graph` is a tuple of `Op`s in topological order. Every value id is
  defined exactly once: by a graph input or by one op output. Ids are dense,
  `0 .. len(values) - 1`, and `values[i].id == i`.
- An op argument is either a `Ref` to a value or a literal (`Lit`): None,
  bool, int, float, str, `DType`, or a tuple of these. Nothing opaque.
  The string `DEVICE` stands for the device the op runs on.
- Op kinds are strings naming the aten overload (`aten.linear.default`) or a
  meshplan op (`meshplan.grad_sum`); their behaviour lives in `ops/`.
- An op output id of `ABSENT` (-1) is a kernel output left undefined.
- Forward and backward ops run once per micro-batch; optimizer ops run once
  per step (`Phase`).
- A parameter or buffer reachable under several names (a tied weight) is
  one graph input, named as torch.export names it; its other names live in
  its facts (`GraphFacts.aliases`, `Graph.aliases`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable, Union

import torch

from meshplan.ir.choices import Precision
from meshplan.ir.graph_facts import GraphFacts


class Phase(enum.Enum):
    """When an op runs: per micro-batch (forward, backward, weight) or per step.

    WEIGHT marks the backward ops a zero-bubble schedule defers: those its
    stage's input gradients do not need (`autodiff/split.py`). Only a Job for
    such a schedule has them; there BACKWARD is the input-gradient part (I)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    WEIGHT = "weight"
    OPTIMIZER = "optimizer"


class Role(enum.Enum):
    """What a graph input stands for."""

    PARAM = "param"        # trainable parameter, keyed by FQN
    BUFFER = "buffer"      # module buffer (BatchNorm running stats), by FQN
    DATA = "data"          # one micro-batch of a user input
    GRAD = "grad"          # accumulated gradient of a parameter, "<fqn>@grad"
    OPT_STATE = "opt_state"  # optimizer state, "<fqn>@<slot>"; the fp16 loss scale
    INTERNAL = "internal"  # produced by an op (never a graph input)


@dataclass(frozen=True, slots=True)
class DType:
    """A torch dtype, by name (`float32`), so the IR serializes as text."""

    name: str

    @staticmethod
    def of(dtype: torch.dtype) -> DType:
        return DType(str(dtype).removeprefix("torch."))

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.name)

    @property
    def itemsize(self) -> int:
        return self.torch.itemsize


# the dtype each mixed precision computes in (the precision pass's casts,
# capture's and the eager reference's autocast)
LOW_DTYPES = {Precision.BF16: DType("bfloat16"), Precision.FP16: DType("float16")}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Logical shape and dtype of one value."""

    shape: tuple[int, ...]
    dtype: DType

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(int(s) for s in t.shape), DType.of(t.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.torch.is_floating_point

    @property
    def carries_grad(self) -> bool:
        """A float or complex tensor: one a gradient flows through (an FFT's
        complex output carries its input's gradient to the loss)."""
        return self.dtype.torch.is_floating_point or self.dtype.torch.is_complex


@dataclass(frozen=True, slots=True)
class Value:
    """One SSA value. `name` is the FQN for params and buffers."""

    id: int
    meta: TensorMeta
    role: Role = Role.INTERNAL
    name: str = ""


ABSENT = -1  # the output id of an undefined (None) kernel output
DEVICE = "$device"  # literal standing for "the device this runs on"
# fp16 dynamic loss scaling: the step-level state holding the scale (its
# first value is the train step's `TrainFacts.loss_scale`; runtime/amp.py).
LOSS_SCALE = "amp@loss_scale"
GRAD_NORM = "optim@grad_norm"  # the step's global gradient norm (clipping)
LR = "optim@lr"                # the step's learning rate (a schedule; ir/lr_schedule.py)
STEP_COUNT = "optim@step"      # steps taken: the schedule's position
# The step-level scalars every rank holds, whatever its stage's ops read: the
# runtime sets them between steps, or reports them (the global norm).
RANK_WIDE = frozenset({LOSS_SCALE, GRAD_NORM, LR, STEP_COUNT})


@dataclass(frozen=True, slots=True)
class Ref:
    """An op argument that refers to a value."""

    id: int


Lit = Union[None, bool, int, float, str, DType, tuple]
Arg = Union[Ref, Lit]


@dataclass(frozen=True, slots=True)
class Op:
    """One operation. `grad_of` is the forward op a backward op belongs to."""

    id: int
    kind: str
    args: tuple[Arg, ...]
    outputs: tuple[int, ...]
    kwargs: tuple[tuple[str, Arg], ...] = ()
    phase: Phase = Phase.FORWARD
    module_path: str = ""
    source: str = ""
    grad_of: int = -1
    _refs: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def refs(self) -> tuple[int, ...]:
        """Ids of every value this op reads, in argument order (worked out
        once per op: every pass asks)."""
        out = self._refs
        if out is None:
            out = refs_in(self.args, self.kwargs)
            object.__setattr__(self, "_refs", out)
        return out

    def renumbered(self, oid: int, grad_of: int, args: tuple | None = None,
                   kwargs: tuple | None = None) -> Op:
        """This op with id `oid`, `grad_of`, and (if given) new args and
        kwargs: `dataclasses.replace` without its cost (passes renumber every op)."""
        op = Op(oid, self.kind, self.args if args is None else args, self.outputs,
                self.kwargs if kwargs is None else kwargs, self.phase, self.module_path,
                self.source, grad_of)
        if args is None and kwargs is None:
            object.__setattr__(op, "_refs", self._refs)  # the same references
        return op

    def remap(self, fn: Callable[[int], int]) -> tuple[tuple[Arg, ...], tuple]:
        """This op's args and kwargs with each `Ref`'s id replaced by `fn(id)`."""
        return (tuple(map_refs(a, fn) for a in self.args),
                tuple((k, map_refs(v, fn)) for k, v in self.kwargs))

    def ref(self, i: int) -> Ref:
        """Argument `i`, which this op's kind makes a `Ref`."""
        a = self.args[i]
        assert isinstance(a, Ref), f"{self.kind} argument {i} is {a!r}, not a Ref"
        return a

    def int_kwarg(self, name: str) -> int:
        """Keyword argument `name`, which this op's kind makes an int."""
        a = dict(self.kwargs)[name]
        assert isinstance(a, int), f"{self.kind} keyword {name} is {a!r}, not an int"
        return a


def refs_in(args: tuple, kwargs: tuple = ()) -> tuple[int, ...]:
    """Ids of every `Ref` in `args` and `kwargs` (name, arg) pairs, in order."""
    out: list[int] = []
    for a in args:
        t = type(a)
        if t is Ref:
            out.append(a.id)
        elif t is tuple:
            _collect_refs(a, out)
    for _, a in kwargs:
        _collect_refs(a, out)
    return tuple(out)


def map_refs(a: Arg, fn: Callable[[int], int]) -> Arg:
    """`a` with each `Ref`'s id replaced by `fn(id)` (tuples recursively)."""
    if isinstance(a, Ref):
        return Ref(fn(a.id))
    if isinstance(a, tuple):
        return tuple(map_refs(x, fn) for x in a)
    return a


def _collect_refs(a: Arg, out: list[int]) -> None:
    if isinstance(a, Ref):
        out.append(a.id)
    elif isinstance(a, tuple):
        for x in a:
            _collect_refs(x, out)


@dataclass(frozen=True, slots=True)
class Update:
    """After a step, state `name` (a param, buffer, grad or optimizer slot)
    takes the value `value`."""

    name: str
    value: int


@dataclass(frozen=True, slots=True)
class Graph:
    """A whole program: forward only after capture, the train step after
    autodiff. `loss` is the scalar loss value of one micro-batch."""

    values: tuple[Value, ...]
    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    loss: int
    updates: tuple[Update, ...] = ()
    facts: GraphFacts = field(default=GraphFacts())
    # (forward value, its total gradient value), set by autodiff: passes use
    # it to place constraints on a gradient (e.g. a colwise input's grad).
    grads: tuple[tuple[int, int], ...] = ()
    # (name, value): what a run reports beside the loss, each micro-batch's
    # value summed over the step (a mixture of experts' tokens per expert)
    reports: tuple[tuple[str, int], ...] = ()

    def value(self, vid: int) -> Value:
        return self.values[vid]

    def inputs_by_role(self, role: Role) -> tuple[Value, ...]:
        return tuple(self.values[i] for i in self.inputs if self.values[i].role is role)

    def ops_in(self, phase: Phase) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.phase is phase)

    def producers(self) -> dict[int, Op]:
        """Map from value id to the op that defines it."""
        return {o: op for op in self.ops for o in op.outputs if o != ABSENT}

    def consumers(self) -> dict[int, list[Op]]:
        """Map from value id to the ops that read it, in graph order."""
        out: dict[int, list[Op]] = {}
        for op in self.ops:
            for r in dict.fromkeys(op.refs()):
                out.setdefault(r, []).append(op)
        return out

    def param_bytes(self) -> int:
        return sum(v.meta.nbytes for v in self.inputs_by_role(Role.PARAM))

    def aliases(self) -> dict[str, str]:
        """Every other name of a shared (tied) parameter or buffer -> the name
        of its one graph input (`head.weight` -> `wte.weight`)."""
        return dict(self.facts.aliases)

    def names_of(self, name: str) -> tuple[str, ...]:
        """`name` (a graph input's) and all its aliases, the input's first."""
        return (name, *sorted(a for a, c in self.aliases().items() if c == name))
