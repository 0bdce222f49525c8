"""A model's own casts under mixed precision.

A model casts by the dtypes it reads: an RMSNorm computes in fp32 and
returns `x.to(input_dtype)`, an attention returns `softmax(s,
dtype=torch.float32).to(query.dtype)`. Under `torch.autocast` those reads
see bf16 where autocast made bf16 (a projection's output), so the casts are
real: up to fp32, and back down. In an fp32 capture every one of them is an
identity, and the precision pass cannot tell `x.to(torch.float32)` from
`x.to(input_dtype)`: the casts were lost, and meshplan computed another
mixed-precision step than the model's (OLMo 2's q/k norms kept fp32 where
the model rounds to bf16).

So a capture for bf16/fp16 traces the forward under `torch.autocast(device,
low)` (`autocast_flow`), and retraces it (functionalization) under the same
autocast: the model's Python reads the dtypes autocast gives and branches
on them as in eager, each of its casts is recorded with the dtype it
resolved to, and autocast's own casts are inlined as `_to_copy` ops. The
graph is the step eager autocast runs. The precision pass then applies
meshplan's lists (CUDA autocast's, `ops/policy.py`) on top: a cast they
add where the capture's flow made the dtype already is none, and a
model's `_to_copy` that is an identity in meshplan's flow is dropped.

Every capture of a module on the meta device, fp32's too, is traced on
fake CPU tensors (`on_fake_device`): the model's code runs as on the CPU,
where the eager reference runs (a tensor it makes on the default device
meets its weights; a branch on the device type goes the CPU's way). So
the flow is CPU autocast's, the eager reference's on this machine. Both put
matmuls, linears, convolutions and attention in the low dtype; CPU's adds
fp32 for losses and a few rare ops (`prod`, `cdist`, the FFTs), which stay
fp32 on a GPU too. So a plan for a GPU computes CUDA autocast's step but
for those.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from meshplan.ir.choices import OpPrecision, Precision
from meshplan.ir.graph import LOW_DTYPES
from meshplan.ops.table import rule_for

_GRAD_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled


def autocast_flow(precision: Precision, inputs: tuple):
    """`torch.autocast` in `precision`'s low dtype, on the device type of
    `inputs` (fake CPU tensors for a meta module: `on_fake_device`); none
    for fp32."""
    if precision not in LOW_DTYPES:
        return nullcontext()
    device = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
    return torch.autocast(device, dtype=LOW_DTYPES[precision].torch)


@contextmanager
def on_fake_device(module: nn.Module, inputs: tuple) -> Iterator[tuple]:
    """While it lasts, every meta tensor of `module` (parameters, buffers and
    plain tensor attributes) is a fake CPU tensor, the same one for a tensor
    held under several names (ties stay ties); yields `inputs` made fake
    alike. The model's code then runs as on the CPU, where the reference
    runs: autocast applies (never to meta tensors), a tensor it makes on
    the default device meets its weights (XLNet's masks: meta and CPU
    mixed, refused), a branch on the device type goes the CPU's way. Fake
    tensors allocate nothing. The module's own tensors are put back after."""
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            f = mode.fake_tensor_converter.from_meta_and_device(mode, t.detach(),
                                                                 torch.device("cpu"))
            made[id(t)] = nn.Parameter(f, t.requires_grad) if isinstance(t, nn.Parameter) else f
        return made[id(t)]

    swapped: list[tuple[dict, str, torch.Tensor]] = []
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers, mod.__dict__):
            for name, t in list(table.items()):
                if isinstance(t, torch.Tensor) and t.is_meta:
                    swapped.append((table, name, t))
                    table[name] = fake(t)
    try:
        yield tuple(fake(t) if isinstance(t, torch.Tensor) and t.is_meta else t
                    for t in inputs)
    finally:
        for table, name, t in swapped:
            table[name] = t


def is_fake(t: torch.Tensor) -> bool:
    """A tensor `on_fake_device` made: it has no value, as a meta one."""
    return isinstance(t, FakeTensor)


def lower_inside(gm: fx.GraphModule, precision: Precision) -> None:
    """In place, before the retrace: each float input of an op autocast
    lowers only inside (`OpPrecision.LOW_INSIDE`: einsum, whose bmm it
    casts) cast to the low dtype, as eager autocast computes it. Export
    keeps the op whole, and its retrace would run it below autocast, on
    the dtypes the model gave it (PEGASUS-X: bf16 with fp32, refused). An
    autocast region of the model's own keeps its own rule (not entered)."""
    low = LOW_DTYPES[precision].torch
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _GRAD_REGION:
            lower_inside(getattr(gm, node.args[1].target), precision)
        elif str(node.target).startswith("aten.") and \
                rule_for(str(node.target)).precision is OpPrecision.LOW_INSIDE:
            node.args = tuple(_cast_before(gm, a, node, low) for a in node.args)
    gm.recompile()


def _cast_before(gm: fx.GraphModule, a, before: fx.Node, low: torch.dtype):
    """`a` (a node, or a list of them) cast to `low` before `before`, where a float."""
    if isinstance(a, (list, tuple)):
        return type(a)(_cast_before(gm, x, before, low) for x in a)
    val = a.meta.get("val") if isinstance(a, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dtype == low:
        return a
    with gm.graph.inserting_before(before):
        out = gm.graph.call_function(torch.ops.aten._to_copy.default, (a,), {"dtype": low})
    out.meta = {**a.meta, "val": val.to(low)}
    return out
