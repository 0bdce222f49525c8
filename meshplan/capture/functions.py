"""A `torch.autograd.Function` kept whole through capture: its forward and
its own backward.

torch.export (2.13, non-strict) traces through a Function's forward and
keeps no trace of its backward. Where the backward is not the forward's
derivative (a straight-through estimator; transformers' RecurrentGemma
clips its derivative, PhiMoE's router multiplier and YOSO's attention write
their own), a model captured so would train otherwise than in eager
PyTorch. So while capture exports (`kept_whole`), each application of a
Function defined outside torch is one `meshplan_fn::apply` op
(`ops/function_op.py`), whose gradient is the Function's own backward.

Invariants:
- A Function defined inside a function (no rank's process could import
  it) and one taking an argument JSON cannot hold are refused in one line.
- The op is replicated (the generic rule's signature for a custom op):
  meshplan cannot know which splits a Function's backward commutes with.
- A Function in `DERIVATIVE` (its backward is its forward's derivative,
  tested in tests/capture/test_functions.py) is traced through, as export
  does, so that its ops keep their splits; so is one whose backward cannot
  run (under `no_grad`, or on tensors none of which requires grad).
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import torch
from torch.utils import _pytree as pytree

from meshplan.errors import CaptureError
from meshplan.ops.function_op import (
    APPLY,
    HERE,
    OUTPUTS,
    apply_op,
    path_of,
    spelled,
    unflatten,
)

# Functions whose backward is the derivative of their forward (up to
# rounding), traced through so their ops keep their splits; each is tested
# against torch's autograd of its forward
DERIVATIVE = frozenset({
    "transformers.models.bloom.modeling_bloom:GeLUFunction",
})


@contextmanager
def kept_whole():
    """While torch exports: each Function defined outside torch, but those
    in `DERIVATIVE`, applied as one `meshplan_fn::apply` op."""
    def apply(cls, *args, **kwargs):
        if getattr(HERE, "inside", False) or _traced_through(cls, (args, kwargs)):
            return APPLY.__func__(cls, *args, **kwargs)
        return _as_op(cls, args, kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = APPLY


def _traced_through(cls: type, args) -> bool:
    """torch's own Functions, those in `DERIVATIVE`, and any whose backward
    cannot run (grad mode off, or no input that requires grad)."""
    return (cls.__module__.split(".")[0] == "torch" or path_of(cls) in DERIVATIVE
            or not torch.is_grad_enabled()
            or not any(isinstance(t, torch.Tensor) and t.requires_grad
                       for t in pytree.tree_leaves(args)))


def _as_op(cls: type, args: tuple, kwargs: dict):
    path = path_of(cls)
    if "<locals>" in path:
        raise CaptureError(f"torch.autograd.Function {cls.__qualname__} is defined inside a "
                           "function, where a rank's process cannot import it; define it at "
                           f"the top level of module {cls.__module__}")
    layout, tensors = spelled(cls, (args, kwargs))
    device = next((t.device.type for t in tensors), "cpu")
    if torch.is_autocast_enabled(device):  # its forward runs under it, as eager's does
        layout["autocast"] = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
    text = json.dumps(layout)
    flat = apply_op(path, text, tensors)  # its kernel spells the outputs' structure
    return unflatten(OUTPUTS[path, text], flat)
