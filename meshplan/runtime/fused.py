"""Runs of a segment's compute ops handed to Inductor as one FX graph each
(`--kernels inductor`, docs/concepts/kernels.md).

Invariants:
- A run is a maximal sequence of consecutive ops of one compiled segment
  (`codegen.compile_segment`) that run their own kernels: no collective,
  variant, bucket, prefetch, random or routed experts kernel of the rank's (those stay
  meshplan's calls, so the schedule, the overlap and the proofs are as
  with eager kernels), and no hook after them, holding two or more ops
  Inductor fuses (`OpRule.fuses`; a shorter one runs as eager kernels).
- The graph is the run's ops as aten calls on its inputs, returning the
  values the segment reads after the run. At its first call it is loaded
  from this machine's cache of AOTInductor builds, built into it first if
  no process has (`kernel_cache.py`: one build per machine for equal runs
  of several ranks), for the real inputs' metas (static shapes: a
  segment's shapes do not change from step to step). Each call checks its
  inputs' metas: other metas get (or build) their own artifact.
- The optimizer's updates are in no run: torch's fused kernel runs them
  (`OpRule.fused_batched`, `codegen._call_line`).
- The job's first step runs each run's graph with eager kernels, as it is
  built (accumulations specialized, outputs marked as a built run marks
  them: the next steps call the same variants), and notes each variant;
  `builds.build_noted` builds them at the next step's start, every rank at
  once.
- A run Inductor refuses runs its graph eagerly (the same kernels, in
  order, as rehearsed), with one warning naming the run and the reason.
"""

from __future__ import annotations

import collections
import copy
import importlib.util
import operator
import os
import shutil
import time
import warnings
from typing import Callable

import torch
import torch.fx as fx

from meshplan.errors import ConfigError
from meshplan.ir import ABSENT, DEVICE, DType, Op, Ref
from meshplan.ir.choices import Kernels, choose
from meshplan.ops import kernels
from meshplan.ops.table import rule_for
from meshplan.runtime.devices import resolve_device
from meshplan.runtime.kernel_cache import (
    Refused,
    ahead_of_time,
    input_metas,
    measured_once,
    rehearsal_file,
    template,
)


def check_kernels(kernels: str, device) -> None:
    """A user's `--kernels inductor` where this machine cannot compile: one line."""
    choose(Kernels, kernels, "kernels")
    if kernels == Kernels.INDUCTOR and (why := _missing(resolve_device(str(device)))):
        raise ConfigError(why)


def can_compile(device: str = "cpu") -> bool:
    return not _missing(device)


def _missing(device_type: str) -> str:
    """Why Inductor cannot compile for `device_type` here ("" when it can)."""
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return ("--kernels inductor on cuda needs Triton, which this Python lacks; "
                    "pip install triton, or use --kernels eager")
        return ""
    cxx = os.environ.get("CXX") or "g++"  # what Inductor's builder runs on Linux
    if shutil.which(cxx) is None:
        return ("--kernels inductor on cpu needs a C++ compiler (g++ or clang++ on the PATH, "
                "or $CXX), which this machine lacks; install one, or use --kernels eager")
    return ""


def kernel_of(op: Op) -> Callable:
    return rule_for(op.kind).kernel  # an OpOverload itself: FX names it


def graph_of(ops: list[Op], ins: list[int], outs: list[int], device) -> fx.GraphModule:
    """The run's ops as one FX graph: placeholders `ins`, output `outs`. Its
    names are positions, not value ids: equal runs of several ranks have
    equal code (one build)."""
    g = fx.Graph()
    node: dict[int, fx.Node] = {v: g.placeholder(f"a{i}") for i, v in enumerate(ins)}

    def arg(a):
        if isinstance(a, Ref):
            return node[a.id]
        if isinstance(a, tuple):
            return [arg(x) for x in a]
        if isinstance(a, DType):
            return a.torch
        if a == DEVICE:
            return device
        return a

    for op in ops:
        kwargs = {k: arg(v) for k, v in op.kwargs}
        call = g.call_function(kernel_of(op), tuple(arg(a) for a in op.args), kwargs)
        if len(op.outputs) == 1 and not rule_for(op.kind).returns_list:
            if op.outputs[0] != ABSENT:
                node[op.outputs[0]] = call
            continue
        for i, o in enumerate(op.outputs):
            if o != ABSENT:
                node[o] = g.call_function(operator.getitem, (call, i))
    g.output(tuple(node[v] for v in outs))
    return fx.GraphModule(torch.nn.Module(), g)


class InductorRun:
    """A run's callable: `(*ins) -> outs`, built (or loaded) on its first call.
    On a CPU each variant's first call also measures the bytes the run
    allocates at its high-water mark (`kernel_cache.measured`: Inductor's
    buffers are not values the executor holds); every call then counts them
    in `mem`'s peak, on top of what is live (a GPU's allocator sees them).

    While `rehearsing()` (the job's first step) a call runs the graph with
    eager kernels and notes its variant; `builds.build_noted` then builds them all,
    every rank at once, before the next step loads them."""

    def __init__(self, ops: list[Op], ins: list[int], outs: list[int], device, name: str,
                 mem=None, on_built: Callable[[], None] | None = None,
                 rehearsing: Callable[[], bool] | None = None):
        self.ops, self.name, self.device, self.mem = ops, name, torch.device(device), mem
        self.on_built = on_built  # told of each variant built or loaded (a watchdog's progress)
        self.rehearsing = rehearsing
        # a rehearsed variant's metas -> (its graph, marked as built; its inputs' templates;
        # its scratch)
        self.noted: dict[tuple, tuple[Callable, list, int]] = {}
        self.ins, self.outs = ins, outs
        self.gm = graph_of(ops, ins, outs, self.device)
        self.accumulators = _accumulators(self.gm)
        self.fn: Callable | None = None
        self.metas: tuple | None = None  # the inputs `fn` was built for
        self.scratch = 0  # bytes `fn` allocates at its high-water mark (CPU)
        self.built: dict[tuple, tuple[Callable, int]] = {}  # by input metas
        self.note = ""  # why it runs eagerly, when Inductor refused it
        self.compile_s = 0.0  # its first calls: built (or loaded) and run

    def __call__(self, *args):
        metas = input_metas(args)
        if metas != self.metas:
            return self._first(metas, args)
        if self.mem is not None:
            self.mem.transient(self.scratch)
        return self.fn(*args)  # type: ignore[misc]

    def _first(self, metas: tuple, args):
        """A call with inputs of new metas: their variant built or loaded
        (or eager, if refused), run, and its scratch measured once."""
        t0 = time.perf_counter()
        if metas in self.built:
            self.fn, self.scratch = self.built[metas]
            self.metas = metas
            return self(*args)
        if self.rehearsing is not None and self.rehearsing():
            return self._rehearse(metas, args)
        lib, gm = None, specialized(self.gm, args)
        try:
            built = ahead_of_time(gm, args, self.device)
            lib = getattr(built, "artifact", None)
            fn = _marking(built, *self._marks(args))
        except Refused as err:
            kinds = sorted({op.kind for op in self.ops})
            self.note = (f"{self.name}: Inductor refused a run of {len(self.ops)} ops "
                         f"({', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''}): "
                         f"{err}; it runs with eager kernels")
            warnings.warn(self.note, stacklevel=2)
            fn = _marking(gm, *self._marks(args))  # its aten kernels, in order, as rehearsed
        if self.on_built is not None:
            self.on_built()
        if self.device.type == "cpu":
            out, scratch = measured_once(fn, args, lib and lib.with_suffix(".scratch"))
        else:
            out, scratch = fn(*args), 0
        self.built[metas] = (fn, scratch)
        self.fn, self.metas, self.scratch = fn, metas, scratch
        if self.mem is not None:
            self.mem.transient(scratch)
        self.compile_s += time.perf_counter() - t0
        return out

    def noted_tasks(self) -> list[tuple]:
        """Each variant the rehearsal noted, as `builds.build_task` takes it."""
        return [(self.ops, self.ins, self.outs, templates, self.device)
                for _, templates, _ in self.noted.values()]

    def _marks(self, args) -> tuple[list[int], list[int]]:
        """(owned, adopted) outputs for `_marking`: accumulations into a
        tensor, and first gradients (the accumulator None)."""
        return ([i for i, acc in self.accumulators if args[acc] is not None],
                [i for i, acc in self.accumulators if args[acc] is None])

    def _rehearse(self, metas: tuple, args):
        """A call of the job's first step: the variant's graph (specialized as
        it is built) run with eager kernels, its outputs marked as a built
        run marks them, so the next steps call the variants this one did;
        noted, with its scratch measured once a machine (CPU) and counted as
        a built run's is."""
        if metas not in self.noted:
            gm = specialized(self.gm, args)
            fn = _marking(gm, *self._marks(args))
            out, scratch = (measured_once(fn, args, rehearsal_file(gm, args, self.device))
                            if self.device.type == "cpu" else (fn(*args), 0))
            self.noted[metas] = (fn, [template(a) for a in args], scratch)
        else:
            fn, _, scratch = self.noted[metas]
            out = fn(*args)
        if self.mem is not None:
            self.mem.transient(scratch)
        return out


def _accumulators(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """(output, input) positions of `gm`'s gradient accumulations whose
    accumulator is an input: their result is the step's own accumulator
    whenever that input is a tensor (`kernels.accumulate_grad`)."""
    ins = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    (outs,) = (n.args[0] for n in gm.graph.nodes if n.op == "output")
    return [(i, ins[o.args[0]]) for i, o in enumerate(outs)
            if o.op == "call_function" and o.target is kernels.accumulate_grad
            and o.args[0] in ins]


def specialized(gm: fx.GraphModule, args) -> fx.GraphModule:
    """`gm` with each accumulation into an input accumulator as the aten op it
    runs on these inputs (`kernels.accumulate_grad`: into an owned tensor in
    place, into another out of place; a None one stays, and adopts): a
    trace sees fake tensors, which do not carry the mark of ownership."""
    ins = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ops = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is kernels.accumulate_grad \
                and node.args[0] in ins and (acc := args[ins.index(node.args[0])]) is not None:
            owned = getattr(acc, kernels.OWNED, False)
            ops[node.name] = torch.ops.aten.add_.Tensor if owned else torch.ops.aten.add.Tensor
    if not ops:
        return gm
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.name in ops:
            node.target = ops[node.name]
    return fx.GraphModule(gm, graph)


def _marking(fn: Callable, owned: list[int], adopted: list[int]) -> Callable:
    """`fn`, marking as accumulators the step owns the outputs at `owned`
    (sums into an accumulator, as `accumulate_grad` marks them when it runs
    itself: a built run returns plain tensors) and those at `adopted` (a
    first gradient) that are the run's own buffers: dense, sharing storage
    with no other input or output. Later micro-batches add into those in
    place, where eager kernels first add out of place into a fresh tensor
    (an adopted gradient may be an expanded view, or another parameter's):
    the same values, one copy less, and one variant of the run less to
    build (`accumulate_grad` into an owned tensor, never into a borrowed one)."""
    if not owned and not adopted:
        return fn

    def call(*args):
        out = fn(*args)
        for i in owned:
            kernels.own(out[i])
        if adopted:
            for i in _alone(out, args, adopted):
                kernels.own(out[i])
        return out

    return call


def _alone(out, args, positions: list[int]) -> list[int]:
    """Of `positions` in `out`, those of dense tensors whose storage no other
    input or output shares."""
    tensors = [x for x in (*out, *args) if isinstance(x, torch.Tensor)]
    users = collections.Counter(x.untyped_storage().data_ptr() for x in tensors)
    return [i for i in positions if isinstance(t := out[i], torch.Tensor) and t.numel()
            and t.is_contiguous() and users[t.untyped_storage().data_ptr()] == 1]
