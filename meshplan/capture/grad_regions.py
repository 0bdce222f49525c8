"""Grad-mode and autocast regions of a forward (`torch.no_grad()`,
`torch.enable_grad()`, `torch.autocast(...)` inside `forward`).

Export keeps each such region as a higher-order op over a submodule
(`wrap_with_set_grad_enabled`, `wrap_with_autocast`). torch's own
`run_decompositions` inlines them: an autocast region with its casts made
explicit, which is its meaning, but a grad-mode region as plain ops, which
is not: its values then carry gradients, and a buffer updated under
`no_grad` (an EMA) sent gradients back into the activations it read
(measured: trained wrong, and only `verify` saw it).

So before the program is inlined, every value that leaves a grad-disabled
region is detached where it leaves: the region's outputs, and what it
passes into a nested `enable_grad` region. Values passed through
unchanged (the region's own inputs) and those an inner region made keep
their gradients, as in eager PyTorch. An `aten.detach` is no
differentiable op (`ops/table.py`), so autodiff sends no gradient back
through it. Autocast regions take their enclosing grad mode (export nests
an autocast block inside a `no_grad` one: `autocast_inside_no_grad` in the
mutation table). Export 2.13 makes an `enable_grad` inside a `no_grad` a
sibling region, not a nested one; the nested form is handled all the same.
"""

from __future__ import annotations

import torch
from torch import fx

_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
REGIONS = (_GRAD, _AUTOCAST)


def has_regions(gm: fx.GraphModule) -> bool:
    """Whether the program holds a grad-mode or autocast region."""
    return any(node.op == "call_function" and node.target in REGIONS for node in gm.graph.nodes)


def detach_no_grad_values(gm: fx.GraphModule, enabled: bool = True) -> None:
    """Detach, in place, each value leaving a grad-disabled region of `gm`
    (whose own grad mode is `enabled`), at every depth."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in REGIONS:
            inner = node.args[0] if node.target is _GRAD else enabled
            sub = node.args[1] if node.target is _GRAD else node.args[4]
            detach_no_grad_values(getattr(gm, sub.target), inner)
    if enabled:
        return
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _GRAD and node.args[0]:
            node.args = (*node.args[:2], *(_detached(gm, a, node) for a in node.args[2:]))
        elif node.op == "output":
            outs = node.args[0]
            node.args = (tuple(_detached(gm, a, node) for a in outs)
                         if isinstance(outs, (list, tuple)) else _detached(gm, outs, node),)
    gm.recompile()


def _detached(gm: fx.GraphModule, value, before: fx.Node):
    """`value` detached before `before`, if an op of this region made it."""
    if not isinstance(value, fx.Node) or not _made_here(value):
        return value
    with gm.graph.inserting_before(before):
        out = gm.graph.call_function(torch.ops.aten.detach.default, (value,))
    out.meta = {k: v for k, v in value.meta.items() if k in ("val", "nn_module_stack",
                                                                "stack_trace")}
    return out


def _made_here(node: fx.Node) -> bool:
    """A tensor an op of this region computed: not one of its inputs, not
    what an inner region returned (that region decided), not a non-float."""
    if node.op != "call_function":
        return False
    src = node.args[0] if node.target.__name__ == "getitem" else None
    if isinstance(src, fx.Node) and src.op == "call_function" and src.target in REGIONS:
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()
