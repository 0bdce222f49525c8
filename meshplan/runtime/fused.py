"""Runs of a segment's compute ops handed to Inductor as one FX graph each
(`--kernels inductor`, docs/concepts/kernels.md).

Invariants:
- A run is a maximal sequence of consecutive ops of one compiled segment
  (`codegen.compile_segment`) that run their own kernels: no collective,
  variant, bucket, prefetch, random or routed experts kernel of the rank's (those stay
  meshplan's calls, so the schedule, the overlap and the proofs are as
  with eager kernels), and no hook after them.
- The graph is the run's ops as aten calls on its inputs, returning the
  values the segment reads after the run; it is compiled on its first call,
  with the real inputs (static shapes: a segment's shapes do not change
  from step to step), by `torch.compile(backend="inductor")`, whose on-disk
  cache the ranks of a machine share; equal runs of several ranks compile
  one at a time (`compile_lock`), so one compiles and the rest load.
- A run Inductor refuses runs its graph eagerly (the same kernels, in order,
  consecutive optimizer ops batched into torch's multi-tensor calls as with
  eager kernels), with one warning naming the run and the reason.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
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
from meshplan.ir.fileio import file_lock
from meshplan.ops.table import rule_for
from meshplan.runtime.codegen import batch_groups
from meshplan.runtime.devices import resolve_device


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
    from torch._inductor import config  # Inductor loads only for --kernels inductor

    cxx = config.cpp.cxx[-1] if isinstance(config.cpp.cxx, tuple) else config.cpp.cxx
    if shutil.which(os.environ.get("CXX", cxx or "g++")) is None:
        return ("--kernels inductor on cpu needs a C++ compiler (g++ or clang++ on the PATH, "
                "or $CXX), which this machine lacks; install one, or use --kernels eager")
    return ""


def kernel_of(op: Op) -> Callable:
    return rule_for(op.kind).kernel  # an OpOverload itself: FX names it


def graph_of(ops: list[Op], ins: list[int], outs: list[int], device,
             batched: bool = False) -> fx.GraphModule:
    """The run's ops as one FX graph: placeholders `ins`, output `outs`;
    `batched`: consecutive optimizer ops as one multi-tensor call each, as
    eager kernels run them (`codegen.batch_groups`)."""
    g = fx.Graph()
    node: dict[int, fx.Node] = {v: g.placeholder(f"v{v}") for v in ins}

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

    for group in batch_groups(ops, {}) if batched else [[op] for op in ops]:
        op = group[0]
        kwargs = {k: arg(v) for k, v in op.kwargs}
        if len(group) > 1:  # outputs: one list per output position, an entry per op
            columns = tuple([arg(a) for a in column] for column in zip(*(x.args for x in group)))
            call = g.call_function(rule_for(op.kind).batched, columns, kwargs)
            for i, x in enumerate(group):
                for j, o in enumerate(x.outputs):
                    if o != ABSENT:
                        column_j = g.call_function(operator.getitem, (call, j))
                        node[o] = g.call_function(operator.getitem, (column_j, i))
            continue
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
    """A run's callable: `(*ins) -> tuple(outs)`, compiled on its first call."""

    def __init__(self, ops: list[Op], ins: list[int], outs: list[int], device, name: str):
        self.ops, self.name = ops, name
        self.gm = graph_of(ops, ins, outs, device)
        self.eager = functools.partial(graph_of, ops, ins, outs, device, True)  # if refused
        self.fn: Callable | None = None
        self.note = ""  # why it runs eagerly, when Inductor refused it
        self.compile_s = 0.0  # its first call: compiled (or loaded from the cache) and run

    def __call__(self, *args):
        if self.fn is not None:
            return self.fn(*args)
        compiled = torch.compile(self.gm, backend="inductor", fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        try:  # compiled at this first call; a refusal is raised before anything runs
            with compile_lock(self.gm, args):
                out = compiled(*args)
        except _refusals() as err:
            self.compile_s = time.perf_counter() - t0
            first = (str(err).strip() or type(err).__name__).splitlines()[0]
            kinds = sorted({op.kind for op in self.ops})
            self.note = (f"{self.name}: Inductor refused a run of {len(self.ops)} ops "
                         f"({', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''}): "
                         f"{first[:200]}; it runs with eager kernels")
            warnings.warn(self.note, stacklevel=2)
            self.fn = self.eager()
            return self.fn(*args)
        self.fn = compiled
        self.compile_s = time.perf_counter() - t0
        return out


def compile_key(gm: fx.GraphModule, args) -> str:
    """What Inductor's cache keys a run's compile on, as this process sees it:
    the graph's code and its inputs' shapes, strides, dtypes and devices."""
    metas = [(tuple(a.shape), tuple(a.stride()), str(a.dtype), a.device.type)
             if isinstance(a, torch.Tensor) else repr(a) for a in args]
    return hashlib.sha256(f"{gm.code}\n{metas}".encode()).hexdigest()[:32]


@contextlib.contextmanager
def compile_lock(gm: fx.GraphModule, args):
    """Held while a run is compiled and first run: an exclusive file lock per
    `compile_key`, in Inductor's cache folder. The ranks of a machine whose
    runs are equal (a rank class's members, equal stages) then compile one
    at a time: the first compiles, the others wait and load from the cache
    it filled, instead of all compiling at once. The holder waits on no
    other rank (a run has no communication), so no cycle can form."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # only when compiling

    folder = os.path.join(cache_dir(), "meshplan-locks")
    os.makedirs(folder, exist_ok=True)
    with file_lock(os.path.join(folder, compile_key(gm, args))):
        yield


@functools.cache
def _refusals() -> tuple[type[BaseException], ...]:
    """What `torch.compile` raises while it traces and compiles (before the
    graph runs): dynamo's refusals, the backend's failures."""
    from torch._dynamo import exc  # dynamo loads only when a run is compiled

    out: list = [exc.Unsupported, exc.BackendCompilerFailed, exc.TorchRuntimeError]
    try:
        from torch._inductor.exc import InductorError  # torch >= 2.6
        out.append(InductorError)
    except ImportError:  # older torch
        pass
    return tuple(out)
