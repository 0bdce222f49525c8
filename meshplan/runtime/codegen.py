"""Compile a run of ops into one straight-line Python function.

Invariants:
- Kernels and non-trivial literals are bound once, at compile time; the hot
  loop does no table lookups, no dict access for values, no argument parsing.
- Each value is deleted right after its last use within the segment; values
  that outlive the segment are written to `env`, and read from it.
- `mem` sees every value made and dropped, so the measured peak is exact
  to the storage (views share their base's storage and count once).

The generated source is kept on the function (`fn.source`) for debugging.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from meshplan.capture import DEVICE
from meshplan.ir import ABSENT, DType, Graph, Op, Ref
from meshplan.ops.table import rule_for


class _Consts:
    """Literal values the generated code refers to as `K[i]`."""

    def __init__(self):
        self.items: list = []

    def ref(self, obj) -> str:
        self.items.append(obj)
        return f"K[{len(self.items) - 1}]"


def _expr(a, consts: _Consts, device: torch.device) -> str:
    if isinstance(a, Ref):
        return f"v{a.id}"
    if isinstance(a, tuple):
        return "[" + ", ".join(_expr(x, consts, device) for x in a) + "]"
    if isinstance(a, DType):
        return consts.ref(a.torch)
    if a == DEVICE:
        return consts.ref(device)
    if isinstance(a, float) and not math.isfinite(a):
        return consts.ref(a)
    if a is None or isinstance(a, (bool, int, float, str)):
        return repr(a)
    return consts.ref(a)


def _kernel(kind: str):
    k = rule_for(kind).kernel
    return getattr(k, "_op", k)  # an OpOverload's C++ callable skips a Python frame


def compile_segment(
    graph: Graph,
    ops: Iterable[Op],
    *,
    reads: Iterable[int],
    keeps: Iterable[int],
    device: torch.device,
    name: str = "segment",
) -> Callable:
    """A function `f(env, mem)` that runs `ops` in order.

    `reads`: value ids the segment takes from `env`; `keeps`: value ids it
    must leave in `env` for later segments."""
    ops = list(ops)
    keeps, reads = set(keeps), set(reads)
    consts = _Consts()
    last_use = {}
    for i, op in enumerate(ops):
        for r in op.refs():
            last_use[r] = i
    lines = [f"def {name}(env, mem):"]
    lines += [f"    v{r} = env[{r}]" for r in sorted(set(reads))]
    for i, op in enumerate(ops):
        args = [_expr(a, consts, device) for a in op.args]
        args += [f"{k}={_expr(v, consts, device)}" for k, v in op.kwargs]
        call = f"{consts.ref(_kernel(op.kind))}({', '.join(args)})"
        outs = [f"v{o}" if o != ABSENT else "_" for o in op.outputs]
        target = outs[0] if len(outs) == 1 else ", ".join(outs)
        lines.append(f"    {target} = {call}")
        lines += [f"    mem.add(v{o})" for o in op.outputs if o != ABSENT]
        dead = [r for r in dict.fromkeys(op.refs()) if last_use[r] == i and r not in keeps]
        dead += [o for o in op.outputs if o != ABSENT and o not in last_use and o not in keeps]
        for d in dead:  # values read from env are owned by env: no mem.drop
            lines.append(f"    del v{d}" if d in reads else f"    mem.drop(v{d}); del v{d}")
    lines += [f"    env[{k}] = v{k}" for k in sorted(keeps)]
    lines.append("    return env")
    source = "\n".join(lines) + "\n"
    scope = {"K": consts.items}
    exec(compile(source, f"<meshplan {name}>", "exec"), scope)  # noqa: S102
    fn = scope[name]
    fn.source = source
    return fn
