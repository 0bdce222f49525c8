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

The flow is the autocast of the device the capture's tensors are on; a
module on the meta device is traced on fake CPU tensors (`on_fake_device`),
so it is CPU autocast's, the eager reference's on this machine. Both put
matmuls, linears, convolutions and attention in the low dtype; CPU's adds
fp32 for losses and a few rare ops (`prod`, `cdist`, the FFTs), which stay
fp32 on a GPU too. So a plan for a GPU computes CUDA autocast's step but
for those.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from meshplan.ir.choices import Precision

LOW = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def autocast_flow(precision: Precision, inputs: tuple):
    """`torch.autocast` in `precision`'s low dtype, on the device type of
    `inputs` (fake CPU tensors for a meta module: `on_fake_device`)."""
    device = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
    return torch.autocast(device, dtype=LOW[precision])


def on_meta(module: nn.Module, inputs: tuple) -> bool:
    """Whether the module or its inputs live on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers(), *inputs)
               if isinstance(t, torch.Tensor))


@contextmanager
def on_fake_device(module: nn.Module, inputs: tuple) -> Iterator[tuple]:
    """While it lasts, every meta tensor of `module` (parameters, buffers and
    plain tensor attributes) is a fake CPU tensor, the same one for a tensor
    held under several names (ties stay ties); yields `inputs` made fake
    alike. Autocast applies to CPU tensors, never to meta ones, and fake
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
