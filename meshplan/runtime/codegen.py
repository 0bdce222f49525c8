"""Compile a run of ops into one straight-line Python function.

Invariants:
- Kernels and non-trivial literals are bound once, at compile time; the hot
  loop does no table lookups, no dict access for values, no argument parsing.
- Each value is deleted right after its last use (by an op, or by a hook
  after one) within the segment; values that outlive the segment are
  written to `env`, and read from it.
- `mem` sees every value made and dropped, so the measured peak is exact
  to the storage (views share their base's storage and count once).

The generated source is kept on the function (`fn.source`) for debugging.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from meshplan.ir import ABSENT, DEVICE, DType, Op, Ref
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


def batch_groups(ops: list[Op], kernels: dict) -> list[list[Op]]:
    """Consecutive ops of one batchable kind and equal literals form a group."""
    groups: list[list[Op]] = []
    for op in ops:
        prev = groups[-1][0] if groups else None
        if (prev is not None and rule_for(op.kind).batched is not None
                and op.id not in kernels and prev.id not in kernels
                and prev.kind == op.kind and prev.kwargs == op.kwargs):
            groups[-1].append(op)
        else:
            groups.append([op])
    return groups


def _runs(ops: list[Op], kernels: dict, hooks: dict, keeps: set[int]):
    """Ops as groups: each maximal run of consecutive ops that run their own
    kernels (none in `kernels`, no hook after one, no output shaped by the
    values: `OpRule.data_shapes`, none torch has a fused kernel for:
    `OpRule.fused_batched`) and hold two or more ops Inductor fuses
    (`OpRule.fuses`: a shorter one would cost a build, seconds of C++ on a
    cold cache, and gain nothing) one group, the rest as with eager kernels
    (`batch_groups`); and per run, by its group's index: (its inputs, the
    values it makes that a later group, a hook or `keeps` reads)."""
    def fusable(op: Op) -> bool:  # runs its own kernel, of shapes known ahead
        rule = rule_for(op.kind)
        return (op.id not in kernels and op.id not in hooks and not rule.data_shapes
                and not rule.fused_batched)

    spans: list[list[Op]] = []
    for op in ops:
        if fusable(op) and spans and fusable(spans[-1][-1]):
            spans[-1].append(op)
        else:
            spans.append([op])
    groups: list[list[Op]] = []
    built: set[int] = set()  # the groups that are runs
    eager: list[Op] = []  # consecutive ops that run as with eager kernels
    for span in spans:
        if sum(rule_for(op.kind).fuses for op in span) < 2:
            eager += span
            continue
        groups += batch_groups(eager, kernels)
        eager = []
        built.add(len(groups))
        groups.append(span)
    groups += batch_groups(eager, kernels)
    later: set[int] = set(keeps)
    runs: dict[int, tuple[list[int], list[int]]] = {}
    for i in range(len(groups) - 1, -1, -1):
        group = groups[i]
        made = {o for op in group for o in op.outputs if o != ABSENT}
        if i in built:
            ins = list(dict.fromkeys(r for op in group for r in op.refs() if r not in made))
            runs[i] = (ins, [o for op in group for o in op.outputs
                             if o != ABSENT and o in later])
            later |= set(ins)
        else:
            later |= {r for op in group for r in op.refs()}
        later |= {v for op in group if op.id in hooks for v in hooks[op.id][1]}
    return groups, runs


def _call_line(group: list[Op], consts: _Consts, device, kernels: dict,
               fused: bool = False) -> str:
    """`outputs = kernel(args)` for one op, or one batched call for a group
    (`fused`: torch's fused kernel where the op has one, a group of one too:
    `OpRule.fused_batched`)."""
    def outs(op):
        return [f"v{o}" if o != ABSENT else "_" for o in op.outputs]

    rule = rule_for(group[0].kind)
    fused = fused and rule.fused_batched and group[0].id not in kernels
    kw = [f"{k}={_expr(v, consts, device)}" for k, v in group[0].kwargs]
    if len(group) == 1 and not fused:
        (op,) = group
        args = [_expr(a, consts, device) for a in op.args] + kw
        names = outs(op)  # a list of one tensor is unpacked too
        unpack = len(names) > 1 or rule.returns_list
        target = ", ".join(names) + ("," if len(names) == 1 else "") if unpack else names[0]
        kernel = kernels.get(op.id) or _kernel(op.kind)
        return f"    {target} = {consts.ref(kernel)}({', '.join(args)})"
    kw += ["fused=True"] if fused else []
    kernel = consts.ref(rule.batched)
    columns = zip(*(op.args for op in group))
    args = ["[" + ", ".join(_expr(a, consts, device) for a in col) + "]" for col in columns]
    targets = ", ".join("[" + ", ".join(col) + "]" for col in zip(*(outs(op) for op in group)))
    return f"    {targets} = {kernel}({', '.join(args + kw)})"


def compile_segment(
    ops: Iterable[Op],
    *,
    reads: Iterable[int],
    keeps: Iterable[int],
    device: torch.device,
    name: str = "segment",
    kernels: dict | None = None,
    borrowed: Iterable[int] = (),
    hooks: dict | None = None,
    fuse: Callable | None = None,
) -> Callable:
    """A function `f(env, mem)` that runs `ops` in order.

    `reads`: value ids the segment takes from `env`; `keeps`: value ids it
    must leave in `env` for later segments. Runs of batchable ops (see
    `OpRule.batched`) become one call. `kernels` overrides the callable of
    an op by id (a rank's variant or collective). A read value that dies
    here leaves `env` too (and `mem`), unless it is `borrowed` (owned by
    someone else, like the state). `hooks` ({op id: (fn, value ids)}) calls
    `fn([values])` right after that op (a gradient bucket starting); a value
    a hook reads lives until then. `fuse(ops, ins, outs, name)`, when given,
    makes the callable of each run of ops that run their own kernels, two
    or more of which Inductor fuses (`_runs`, `fused.py`): one call from the
    run's inputs to the values read after it."""
    kernels, hooks = kernels or {}, hooks or {}
    keeps, reads, borrowed = set(keeps), set(reads), set(borrowed)
    if fuse is None:
        groups = batch_groups(list(ops), kernels)
        runs: dict[int, tuple[list[int], list[int]]] = {}
    else:
        groups, runs = _runs(list(ops), kernels, hooks, keeps)
    consts = _Consts()
    made_runs: list = []  # the callables `fuse` made, in order

    def hooked(group) -> list[int]:  # the values a hook after one of `group`'s ops reads
        return [v for op in group if op.id in hooks for v in hooks[op.id][1]]

    def refs(i: int, group) -> list[int]:  # a run reads its inputs only
        return runs[i][0] if i in runs else [r for op in group for r in op.refs()]

    last_use = {}
    for i, group in enumerate(groups):
        for r in refs(i, group):
            last_use[r] = i
        for v in hooked(group):
            last_use[v] = i
    lines = [f"def {name}(env, mem):"]
    line_ops: dict[int, tuple[int, ...]] = {}  # source line -> ops it calls
    lines += [f"    v{r} = env[{r}]" for r in sorted(reads)]
    for i, group in enumerate(groups):
        if i in runs:
            ins, made = runs[i]
            made_runs.append(fuse(group, ins, made, f"{name} run {i}"))
            call = consts.ref(made_runs[-1])
            lines.append(f"    {''.join(f'v{o}, ' for o in made)}= "
                         f"{call}({', '.join(f'v{r}' for r in ins)})")
        else:
            lines.append(_call_line(group, consts, device, kernels, fuse is not None))
            made = [o for op in group for o in op.outputs if o != ABSENT]
        line_ops[len(lines)] = tuple(op.id for op in group)
        lines += [f"    mem.add(v{o})" for o in made]
        for op in group:
            if op.id in hooks:
                fn, vids = hooks[op.id]
                lines.append(f"    {consts.ref(fn)}([{', '.join(f'v{v}' for v in vids)}])")
        used = dict.fromkeys(refs(i, group) + hooked(group))
        dead = [r for r in used if last_use[r] == i and r not in keeps]
        dead += [o for o in made if o not in last_use and o not in keeps]
        for d in dead:
            if d in borrowed:
                lines.append(f"    del v{d}")
            elif d in reads:
                lines.append(f"    mem.drop(env.pop({d})); del v{d}")
            else:
                lines.append(f"    mem.drop(v{d}); del v{d}")
    lines += [f"    env[{k}] = v{k}" for k in sorted(keeps)]
    lines.append("    return env")
    source = "\n".join(lines) + "\n"
    scope = {"K": consts.items}
    exec(compile(source, f"<meshplan {name}>", "exec"), scope)  # noqa: S102
    fn = scope[name]
    fn.source = source
    fn.line_ops = line_ops
    fn.runs = made_runs
    return fn


def failing_ops(fn: Callable, err: BaseException) -> tuple[int, ...]:
    """The op ids of the call in `fn` (a compiled segment) that raised `err`."""
    tb = err.__traceback__
    ops: tuple[int, ...] = ()
    while tb is not None:
        if tb.tb_frame.f_code is fn.__code__:
            ops = fn.line_ops.get(tb.tb_lineno, ())
        tb = tb.tb_next
    return ops
