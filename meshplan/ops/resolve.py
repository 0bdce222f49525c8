"""Op kind strings to torch callables, and what a custom op brings.

Invariant: a custom op (any namespace but aten's, registered with
`torch.library`) trains through the generic rule only when it has a fake
(meta) kernel, for shapes, and an autograd formula, for its gradient;
`custom_op_missing` names what it lacks. A graph records the module that
registers each of its custom ops (`custom_op_module`), so that a rank's own
process, reading the graph, has them too.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Callable

import torch
from torch._library.custom_ops import OPDEFS  # torch's registry of torch.library.custom_op
from torch._library.simple_registry import singleton  # and of fake kernels

from meshplan.errors import CaptureError
from meshplan.ir.kinds import PREFIX as MESHPLAN_PREFIX
from meshplan.ops.function_op import KIND as FUNCTION
from meshplan.ops.function_op import function_module


@cache
def resolve_op(kind: str) -> Callable:
    """`aten.linear.default` -> `torch.ops.aten.linear.default` (any namespace)."""
    parts = kind.split(".")
    if len(parts) != 3:
        raise CaptureError(f"op kind {kind!r} is not of the form namespace.name.overload")
    ns, name, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError) as e:
        hint = "" if ns == "aten" else ("; import the module that registers it (with "
                                        "torch.library) before meshplan reads the graph")
        raise CaptureError(f"unknown torch op {kind!r}: {e}{hint}") from e


def is_custom(kind: str) -> bool:
    """Whether `kind` is a custom op: neither aten's nor meshplan's own."""
    return not kind.startswith(("aten.", MESHPLAN_PREFIX))


FAKE_KERNEL, AUTOGRAD_FORMULA = "fake (meta) kernel", "autograd formula"  # what it may lack


def _registered(kind: str) -> tuple[str, Any, Any]:
    """`kind`'s qualified name, its `custom_op` definition (None if made
    otherwise) and its registered fake kernel (None if none)."""
    ns, name, _ = kind.split(".")
    qualname = f"{ns}::{name}"
    return qualname, OPDEFS.get(qualname), singleton.find(qualname).fake_impl.kernel


def _has_kernel(qualname: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)


def custom_op_missing(kind: str) -> tuple[str, ...]:
    """What custom op `kind` (`ns.name.overload`) lacks to train through the
    generic rule: `FAKE_KERNEL`, `AUTOGRAD_FORMULA`, or nothing."""
    resolve_op(kind)  # an unknown op is refused as such
    qualname, opdef, registered_fake = _registered(kind)
    implicit = _has_kernel(qualname, "CompositeImplicitAutograd")  # decomposes: both for free
    if opdef is not None:  # custom_op's own fake and autograd kernels raise without these
        fake = opdef._abstract_fn is not None
        grad = opdef._backward_fn is not None
    else:
        fake = implicit or _has_kernel(qualname, "Meta") or registered_fake is not None
        grad = implicit or _has_kernel(qualname, "Autograd")
    return tuple(what for what, has in ((FAKE_KERNEL, fake), (AUTOGRAD_FORMULA, grad)) if not has)


def custom_op_module(kind: str) -> str | None:
    """The module whose import registers custom op `kind`: the one defining
    its function (`torch.library.custom_op`) or its fake kernel; None where
    neither is known or it is the running script (no other process has it)."""
    _, opdef, fake = _registered(kind)
    fn = opdef._init_fn if opdef is not None else getattr(fake, "func", None)
    module = getattr(fn, "__module__", None)
    return None if module in (None, "__main__") else module


def modules_of(ops) -> tuple[str, ...]:
    """The modules a process imports to run `ops`: each custom op's
    registering module (`custom_op_module`) and each kept-whole Function's
    (`function_op.function_module`)."""
    found = {custom_op_module(kind) for kind in {op.kind for op in ops} if is_custom(kind)}
    found |= {function_module(op.kind, op.args) for op in ops if op.kind == FUNCTION}
    return tuple(sorted(m for m in found if m is not None))
