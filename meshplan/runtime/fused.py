"""Runs of a segment's compute ops handed to Inductor as one FX graph each
(`--kernels inductor`, docs/concepts/kernels.md).

Invariants:
- A run is a maximal sequence of consecutive ops of one compiled segment
  (`codegen.compile_segment`) that run their own kernels: no collective,
  variant, bucket, prefetch or random kernel of the rank's (those stay
  meshplan's calls, so the schedule, the overlap and the proofs are as
  with eager kernels), and no hook after them.
- The graph is the run's ops as aten calls on its inputs, returning the
  values the segment reads after the run; it is compiled on its first call,
  with the real inputs (static shapes: a segment's shapes do not change
  from step to step), by `torch.compile(backend="inductor")`, whose on-disk
  cache the ranks of a machine share.
- A run Inductor refuses runs its graph eagerly (the same kernels, in order),
  with one warning naming the run and the reason.
"""

from __future__ import annotations

import functools
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
from meshplan.ops.table import rule_for
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


def graph_of(ops: list[Op], ins: list[int], outs: list[int], device) -> fx.GraphModule:
    """The run's ops as one FX graph: placeholders `ins`, output `outs`."""
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

    for op in ops:
        call = g.call_function(kernel_of(op), tuple(arg(a) for a in op.args),
                               {k: arg(v) for k, v in op.kwargs})
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
        self.fn: Callable | None = None
        self.note = ""  # why it runs eagerly, when Inductor refused it
        self.compile_s = 0.0  # its first call: compiled (or loaded from the cache) and run

    def __call__(self, *args):
        if self.fn is not None:
            return self.fn(*args)
        compiled = torch.compile(self.gm, backend="inductor", fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        try:  # compiled at this first call; a refusal is raised before anything runs
            out = compiled(*args)
        except _refusals() as err:
            self.compile_s = time.perf_counter() - t0
            first = (str(err).strip() or type(err).__name__).splitlines()[0]
            kinds = sorted({op.kind for op in self.ops})
            self.note = (f"{self.name}: Inductor refused a run of {len(self.ops)} ops "
                         f"({', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''}): "
                         f"{first[:200]}; it runs with eager kernels")
            warnings.warn(self.note, stacklevel=2)
            self.fn = self.gm
            return self.gm(*args)
        self.fn = compiled
        self.compile_s = time.perf_counter() - t0
        return out


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
