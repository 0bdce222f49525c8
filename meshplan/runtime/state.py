"""A rank's training state: the module's own weights, sliced by SBP.

Invariant: every configuration starts from the same weights as the eager
reference — each parameter and buffer is the module's tensor cut to the
slice (`local_box`) this rank holds; optimizer slots start fresh, gradient
accumulators empty. Only the state this rank's tasks touch is loaded.
A tied tensor is one state entry, found in the module under any alias.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from meshplan.errors import ConfigError
from meshplan.ir import LOSS_SCALE, LR, STEP_COUNT, Role
from meshplan.ir.state_name import StateName
from meshplan.runtime.amp import initial_loss_scale


def cut(t: torch.Tensor, box) -> torch.Tensor:
    """`t` restricted to `box` (a view)."""
    for d, (a, b) in enumerate(box):
        if (a, b) != (0, t.shape[d]):
            t = t.narrow(d, a, b - a)
    return t


def weights_of(module) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by FQN, every name of a tied tensor
    included (a mapping passes through)."""
    if isinstance(module, Mapping):
        return dict(module)
    return {k: t.detach() for k, t in
            (dict(module.named_parameters(remove_duplicate=False))
             | dict(module.named_buffers(remove_duplicate=False))).items()}


def own_tensor(own: Mapping, graph, name: str) -> torch.Tensor:
    """The tensor of graph input `name` in `own`, found under any of its
    names (a tied weight may be saved or loaded under another alias);
    `graph`: a Graph or a StageView (their `names_of`)."""
    for n in graph.names_of(name):
        if n in own:
            return own[n]
    raise ConfigError(f"module has no parameter or buffer '{name}'; "
                      "capture and run the same model")


def initial_state(slot: str, like: torch.Tensor) -> torch.Tensor | None:
    """The value of a fresh optimizer slot (None: created by the first step)."""
    if slot == "momentum_buffer":
        return None
    if slot == "step":  # on the host, as torch.optim keeps it (not capturable):
        return torch.zeros((), dtype=torch.float32)  # reading it costs no GPU sync
    return torch.zeros_like(like, memory_format=torch.preserve_format)


def sliced_state(ctx, module, device, used: set[int] | None = None) -> dict:
    """The state of the rank at `ctx`, for the input values of its stage in
    `used` (all if None); `module` is an `nn.Module` or its `weights_of`
    mapping."""
    own = weights_of(module)
    state: dict = {}
    view = ctx.view
    values = view.values
    for vid in view.inputs:
        v = values[vid]
        if used is not None and vid not in used:
            continue
        if v.role in (Role.PARAM, Role.BUFFER):
            t = own_tensor(own, view, v.name)
            state[v.name] = cut(t.detach(), ctx.box(vid)).to(device, copy=True)
    for vid in view.inputs:
        v = values[vid]
        if used is not None and vid not in used:
            continue
        if v.name == LOSS_SCALE:
            state[v.name] = torch.tensor(initial_loss_scale(view.facts), dtype=torch.float32,
                                         device=device)
        elif v.name in (LR, STEP_COUNT):  # host scalars: the kernels read them with no sync
            state[v.name] = torch.zeros((), dtype=torch.float64)
        elif v.role is Role.OPT_STATE:
            # a slot of the parameter's shape holds its own slice (its layout may
            # differ from the parameter's: ZeRO shards the slots, not the weights)
            name = StateName.parse(v.name)
            full = own_tensor(own, view, name.fqn).detach()
            like = cut(full, ctx.box(vid) if v.meta.shape == tuple(full.shape) else
                       ctx.box(_value_of(view, name.fqn))).to(device)
            state[v.name] = initial_state(name.slot, like)
        elif v.role is Role.GRAD:
            state[v.name] = None
    return state


def _value_of(view, name: str) -> int:
    return next(v.id for v in view.values.values() if v.name == name)
