"""`meshplan_fn::apply`: a `torch.autograd.Function` as one custom op, its
forward and its own backward (capture makes it, `capture/functions.py`).

- Its arguments: the Function's import path (`module:qualname`), the
  structure and non-tensor values of its arguments as JSON (`layout`, and
  the autocast dtype it was applied under, if any: a bf16/fp16 capture's,
  `capture/model_casts.py`), and its tensors, in the places the layout marks.
- Its kernel applies the Function (torch's own `apply`), and so does its
  fake kernel, on fake tensors, for the shapes; its autograd formula runs
  the Function's own backward: the forward again under torch's autograd,
  then `torch.autograd.grad` (one extra forward, the generic rule's price
  for every op).
- The fake kernel refuses, in one line, a Function that draws random
  numbers (the recompute would draw others) or writes its inputs.
- A rank's process imports the Function by its path, once it imported the
  module `function_module` names (`GraphFacts.op_modules`).
"""

from __future__ import annotations

import importlib
import json
import threading
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.errors import CaptureError

KIND = "meshplan_fn.apply.default"
APPLY = torch.autograd.Function.__dict__["apply"]  # torch's own classmethod
HERE = threading.local()  # .inside: a kernel is applying a Function (capture routes none)
# (path, layout) -> the structure of the outputs the Function made: what
# capture rebuilds from the op's flat list (keyed, not the last call's: a
# fake kernel's result torch caches would not run the kernel again)
OUTPUTS: dict[tuple[str, str], dict] = {}


def path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_function(path: str) -> type:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def function_module(kind: str, args: tuple) -> str | None:
    """The module a rank imports for an op's Function (None for another op,
    or one in the running script, which no other process has)."""
    if kind != KIND:
        return None
    module = str(args[0]).partition(":")[0]
    return None if module == "__main__" else module


def leaf(cls: type, x) -> list:
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


def unflatten(spelled: dict, tensors) -> Any:
    """What `spelled` ({"spec", "leaves"}) spells, with `tensors` in its
    tensors' places."""
    it = iter(tensors)
    values = [next(it) if x == ["t"] else
              getattr(torch, x[1]) if x[0] == "dtype" else x[1] for x in spelled["leaves"]]
    return pytree.tree_unflatten(values, pytree.treespec_loads(spelled["spec"]))


def spelled(cls: type, tree) -> tuple[dict, list[Tensor]]:
    """`tree` as ({"spec", "leaves"}, its tensors)."""
    leaves, spec = pytree.tree_flatten(tree)
    return ({"spec": pytree.treespec_dumps(spec), "leaves": [leaf(cls, x) for x in leaves]},
            [x for x in leaves if isinstance(x, Tensor)])


def _call(path: str, layout: str, tensors: list[Tensor]) -> list[Tensor]:
    """Apply the Function at `path` (torch's own `apply`) to the arguments
    `layout` and `tensors` spell; its tensor outputs, in order (their
    structure in `OUTPUTS`). Under the autocast the layout names, as eager
    applied it; on meta tensors (shape inference), where autocast never
    applies, on fake CPU tensors instead."""
    spelled_args = json.loads(layout)
    if spelled_args.get("autocast") and any(t.is_meta for t in tensors):
        return _on_fake_cpu(path, layout, tensors)
    cls = resolve_function(path)
    args, kwargs = unflatten(spelled_args, tensors)
    was, HERE.inside = getattr(HERE, "inside", False), True
    try:
        with _autocast(spelled_args, tensors):
            out = APPLY.__func__(cls, *args, **kwargs)
    finally:
        HERE.inside = was
    OUTPUTS[path, layout], flat = spelled(cls, out)
    return flat


def _autocast(spelled_args: dict, tensors: list[Tensor]):
    """The autocast a layout names, on `tensors`' device type (none if none)."""
    low = spelled_args.get("autocast")
    device = next((t.device.type for t in tensors), "cpu")
    return torch.autocast(device, dtype=getattr(torch, low)) if low else nullcontext()


def _on_fake_cpu(path: str, layout: str, tensors: list[Tensor]) -> list[Tensor]:
    """`_call` on fake CPU copies of meta `tensors`; its outputs on meta."""
    with FakeTensorMode() as mode:
        fakes = [mode.fake_tensor_converter.from_meta_and_device(mode, t, torch.device("cpu"))
                 if t.is_meta else t for t in tensors]
        outs = [(o.shape, o.stride(), o.dtype) for o in _call(path, layout, fakes)]
    return [torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            for shape, stride, dtype in outs]


def _unaliased(outs: list[Tensor], tensors: list[Tensor]) -> list[Tensor]:
    """A custom op's outputs alias neither its inputs nor each other."""
    kept: list[Tensor] = []
    for o in outs:
        if any(torch._C._is_alias_of(o, t)  # type: ignore[attr-defined]
               for t in (*tensors, *kept)):
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
    with _autocast(json.loads(ctx.layout), leaves):  # its own backward, as eager runs it
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                       allow_unused=True) if pairs and wrt
                   else [None] * len(wrt))
    return None, None, [next(got) if t.requires_grad else None for t in leaves]


apply_op.register_autograd(_backward, setup_context=_setup)
