"""A `torch.autograd.Function` kept whole through capture: its forward and
its own backward.

torch.export (2.13, non-strict) traces through a Function's forward and
keeps no trace of its backward. Where the backward is not the forward's
derivative (a straight-through estimator; transformers' RecurrentGemma
clips its derivative, PhiMoE's router multiplier and YOSO's attention write
their own), a model captured so would train otherwise than in eager
PyTorch. So while capture exports (`kept_whole`), each application of a
Function defined outside torch goes through one custom op,
`meshplan_fn::apply`:
- its kernel applies the Function (torch's own `apply`), and so does its
  fake kernel, on fake tensors, for the shapes;
- its autograd formula runs the Function's own backward: the forward again
  under torch's autograd, then `torch.autograd.grad` (one extra forward,
  the generic rule's price for every op).

Invariants:
- The op's arguments are the Function's import path (`module:qualname`),
  the structure and non-tensor values of its arguments as JSON, and its
  tensors. A Function another process cannot import by that path, one
  taking an argument JSON cannot hold, one drawing random numbers (the
  recompute would draw others) and one writing its inputs are refused in
  one line, at capture.
- The graph names each Function's module among those a rank imports
  (`function_modules`, into `GraphFacts.op_modules`).
- The op is replicated (the generic rule's signature for a custom op):
  meshplan cannot know which splits a Function's backward commutes with.
- A Function in `DERIVATIVE` (its backward is its forward's derivative,
  tested in tests/capture/test_functions.py) is traced through, as export
  does, so that its ops keep their splits.
"""

from __future__ import annotations

import importlib
import json
import threading
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.errors import CaptureError

KIND = "meshplan_fn.apply.default"
# Functions whose backward is the derivative of their forward (up to
# rounding), traced through so their ops keep their splits; each is tested
# against torch's autograd of its forward
DERIVATIVE = frozenset({
    "transformers.models.bloom.modeling_bloom:GeLUFunction",
})
_APPLY = torch.autograd.Function.__dict__["apply"]  # torch's own classmethod
_HERE = threading.local()  # .inside: a kernel is applying a Function (do not route)


def path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(path: str) -> type:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@contextmanager
def kept_whole():
    """While torch exports: each Function defined outside torch, but those
    in `DERIVATIVE`, applied as one `meshplan_fn::apply` op."""
    def apply(cls, *args, **kwargs):
        if getattr(_HERE, "inside", False) or _traced_through(cls):
            return _APPLY.__func__(cls, *args, **kwargs)
        return _as_op(cls, args, kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = _APPLY


def _traced_through(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "torch" or path_of(cls) in DERIVATIVE


def _as_op(cls: type, args: tuple, kwargs: dict):
    path = path_of(cls)
    if "<locals>" in path:
        raise CaptureError(f"torch.autograd.Function {cls.__qualname__} is defined inside a "
                           "function, where a rank's process cannot import it; define it at "
                           f"the top level of module {cls.__module__}")
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    layout = json.dumps({"spec": pytree.treespec_dumps(spec),
                         "leaves": [_leaf(cls, x) for x in leaves]})
    flat = apply_op(path, layout, tensors)
    out = _HERE.out  # what the kernel just made: the outputs' structure
    it = iter(flat)
    return pytree.tree_unflatten([next(it) if x == ["t"] else _value(x) for x in out["leaves"]],
                                 pytree.treespec_loads(out["spec"]))


def _leaf(cls: type, x) -> list:
    """A leaf of a Function's arguments or outputs, as JSON: a tensor's place
    (["t"]) or a value."""
    if isinstance(x, Tensor):
        return ["t"]
    if isinstance(x, torch.dtype):
        return ["dtype", str(x).removeprefix("torch.")]
    if x is None or isinstance(x, (bool, int, float, str)):
        return ["v", x]
    raise CaptureError(f"torch.autograd.Function {cls.__qualname__} takes or returns a "
                       f"{type(x).__name__}; meshplan keeps a Function whole when its "
                       "arguments are tensors, numbers, strings, dtypes and lists, tuples or "
                       "dicts of them: pass the others as such")


def _value(x: list):
    return getattr(torch, x[1]) if x[0] == "dtype" else x[1]


def _call(path: str, layout: str, tensors: list[Tensor]) -> list[Tensor]:
    """Apply the Function at `path` (torch's own `apply`) to the arguments
    `layout` and `tensors` spell; its tensor outputs, in order (their
    structure in `_HERE.out`)."""
    cls = _resolve(path)
    spelled = json.loads(layout)
    it = iter(tensors)
    args, kwargs = pytree.tree_unflatten(
        [next(it) if x == ["t"] else _value(x) for x in spelled["leaves"]],
        pytree.treespec_loads(spelled["spec"]))
    was, _HERE.inside = getattr(_HERE, "inside", False), True
    try:
        out = _APPLY.__func__(cls, *args, **kwargs)
    finally:
        _HERE.inside = was
    leaves, spec = pytree.tree_flatten(out)
    _HERE.out = {"spec": pytree.treespec_dumps(spec), "leaves": [_leaf(cls, x) for x in leaves]}
    return [x for x in leaves if isinstance(x, Tensor)]


def _unaliased(outs: list[Tensor], tensors: list[Tensor]) -> list[Tensor]:
    """A custom op's outputs alias neither its inputs nor each other."""
    kept: list[Tensor] = []
    for o in outs:
        if any(torch._C._is_alias_of(o, t) for t in (*tensors, *kept)):
            o = o.clone()
        kept.append(o)
    return kept


@torch.library.custom_op("meshplan_fn::apply", mutates_args=())
def apply_op(path: str, layout: str, tensors: list[Tensor]) -> list[Tensor]:
    """The Function at `path` applied to the arguments `layout` spells with
    `tensors` in the places it marks; its tensor outputs."""
    return _unaliased(_call(path, layout, tensors), tensors)


class _Draws(TorchDispatchMode):
    """Records whether any op run under it draws random numbers."""

    def __init__(self):
        super().__init__()
        self.random = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random = self.random or str(func)
        return func(*args, **(kwargs or {}))


@apply_op.register_fake
def _(path: str, layout: str, tensors: list[Tensor]) -> list[Tensor]:
    versions = [t._version for t in tensors]
    with _Draws() as draws:
        outs = _call(path, layout, tensors)
    name = path.partition(":")[2]
    if draws.random:
        raise CaptureError(f"torch.autograd.Function {name} draws random numbers "
                           f"({draws.random}); meshplan runs its forward again for its "
                           "backward, which would draw others: draw them outside the "
                           "Function and pass them in")
    if [t._version for t in tensors] != versions:
        raise CaptureError(f"torch.autograd.Function {name} writes its inputs in place; "
                           "meshplan keeps a Function whole when it does not: return a new "
                           "tensor instead")
    return _unaliased(outs, tensors)


def _setup(ctx, inputs, output) -> None:
    ctx.path, ctx.layout, tensors = inputs
    ctx.save_for_backward(*tensors)


def _backward(ctx, grads: list[Tensor]):
    """The Function's own backward: its forward again under autograd (on
    leaves detached from the inputs), then `torch.autograd.grad`."""
    leaves = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex())
              for t in ctx.saved_tensors]
    with torch.enable_grad():
        outs = _call(ctx.path, ctx.layout, leaves)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wrt = [t for t in leaves if t.requires_grad]
    got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                   allow_unused=True) if pairs and wrt else [None] * len(wrt))
    return None, None, [next(got) if t.requires_grad else None for t in leaves]


apply_op.register_autograd(_backward, setup_context=_setup)


def function_modules(kind: str, args: tuple) -> tuple[str, ...]:
    """The module a rank imports for an op's Function (none for another op,
    or one in the running script)."""
    if kind != KIND:
        return ()
    module = str(args[0]).partition(":")[0]
    return () if module == "__main__" else (module,)
