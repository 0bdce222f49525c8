"""The optimizer's state slots, and its eager equivalents for reference
runs (torch's optimizer and LR schedulers, built from an `OptimizerConfig`:
`ir/optimizer_config.py`).

Invariant: state names are `<param fqn>@<slot>`; the gradient accumulator of
a parameter is `<fqn>@grad`. Slot order matches the `meshplan.<kind>` op's
inputs after (param, grad).
"""

from __future__ import annotations

import torch
from torch.optim import lr_scheduler as L

from meshplan.ir.choices import LrScheduleKind, OptimizerKind
from meshplan.ir.optimizer_config import OptimizerConfig

__all__ = ["SLOTS", "OptimizerConfig", "slot_meta_shape", "torch_optimizer", "torch_scheduler"]

SLOTS = {OptimizerKind.SGD: ("momentum_buffer",),
         OptimizerKind.ADAMW: ("exp_avg", "exp_avg_sq", "step")}


def torch_optimizer(cfg: OptimizerConfig, module) -> torch.optim.Optimizer:
    """The eager equivalent of `cfg`, for reference runs: torch's optimizer on
    `module`'s parameters (or (name, parameter) pairs), in two groups:
    with and without weight decay."""
    named = list(module.named_parameters() if hasattr(module, "named_parameters")
                 else module)
    groups = [{"params": [p for n, p in named if cfg.decays(n, tuple(p.shape)) == d],
               "weight_decay": cfg.weight_decay if d else 0.0} for d in (True, False)]
    groups = [g for g in groups if g["params"]] or [{"params": []}]
    if cfg.kind == OptimizerKind.SGD:
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=None)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             foreach=None)


def torch_scheduler(cfg: OptimizerConfig, opt: torch.optim.Optimizer):
    """The schedule as torch's own scheduler classes (None: constant), for
    reference runs: LinearLR warmup, then LinearLR / CosineAnnealingLR /
    a stable LambdaLR(1) and LinearLR, chained by SequentialLR."""
    s = cfg.lr_schedule.resolved(cfg.lr)
    if not s.scheduled:
        return None
    parts, milestones = [], []
    if s.warmup_steps:
        parts.append(L.LinearLR(opt, 1 / (s.warmup_steps + 1), 1.0, s.warmup_steps))
        milestones.append(s.warmup_steps)
    low = s.min_lr / cfg.lr
    kind, d = s.kind, s.decay_steps
    if kind == LrScheduleKind.CONSTANT:
        parts.append(L.LambdaLR(opt, lambda k: 1.0))
    elif kind == LrScheduleKind.LINEAR:
        parts.append(L.LinearLR(opt, 1.0, low, d))
    elif kind == LrScheduleKind.COSINE:
        parts.append(L.CosineAnnealingLR(opt, T_max=d, eta_min=s.min_lr))
        milestones.append(s.warmup_steps + d)
        parts.append(L.LambdaLR(opt, lambda k: low))  # held at min_lr after the decay
    else:  # wsd
        assert s.total_steps is not None and d is not None
        parts.append(L.LambdaLR(opt, lambda k: 1.0))
        milestones.append(s.total_steps - d)
        parts.append(L.LinearLR(opt, 1.0, low, d))
    return parts[0] if len(parts) == 1 else L.SequentialLR(opt, parts, milestones)


def slot_meta_shape(slot: str, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    return () if slot == "step" else param_shape

