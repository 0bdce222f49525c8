"""Optimizer configuration, state slots and their initial values.

Invariant: state names are `<param fqn>@<slot>`; the gradient accumulator of
a parameter is `<fqn>@grad`. Slot order matches the `meshplan.<kind>` op's
inputs after (param, grad).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from meshplan.errors import ConfigError
from meshplan.ir.choices import OptimizerKind, choose

SLOTS = {OptimizerKind.SGD: ("momentum_buffer",),
         OptimizerKind.ADAMW: ("exp_avg", "exp_avg_sq", "step")}


@dataclass(frozen=True, slots=True)
class OptimizerConfig:
    """Hyperparameters, with torch.optim's names and meanings."""

    kind: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    # global-norm gradient clipping (`clip_grad_norm_(max_norm)`); None: off
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", choose(OptimizerKind, self.kind, "optimizer"))
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm {self.max_grad_norm} must be > 0; give a "
                              "clipping threshold such as 1.0, or none to turn clipping off")

    @staticmethod
    def default(kind: OptimizerKind | str, lr: float | None = None) -> OptimizerConfig:
        """Defaults: SGD(0.05, momentum 0.9, wd 1e-4), AdamW(3e-3, wd 0.01) (the rates at
        which the zoo's synthetic tasks learn in 10 steps: models/data.py);
        `lr` overrides the learning rate."""
        if kind == OptimizerKind.ADAMW:
            cfg = OptimizerConfig(OptimizerKind.ADAMW, lr=3e-3, weight_decay=0.01)
        else:
            cfg = OptimizerConfig(kind)
        return cfg if lr is None else replace(cfg, lr=lr)

    @staticmethod
    def of(optimizer: OptimizerConfig | OptimizerKind | str, lr: float | None = None,
           **fields) -> OptimizerConfig:
        """`optimizer` as a config: a name takes its defaults (`default`); `lr`
        and `fields` override (`lr=None`: keep)."""
        cfg = optimizer if isinstance(optimizer, OptimizerConfig) \
            else OptimizerConfig.default(optimizer)
        if lr is not None:
            fields["lr"] = lr
        return replace(cfg, **fields) if fields else cfg

    def kwargs(self) -> tuple[tuple[str, object], ...]:
        """The literal arguments of this optimizer's op, after its tensors."""
        if self.kind == OptimizerKind.SGD:
            return (("lr", self.lr), ("momentum", self.momentum),
                    ("weight_decay", self.weight_decay), ("dampening", 0.0),
                    ("nesterov", False))
        return (("lr", self.lr), ("beta1", self.betas[0]), ("beta2", self.betas[1]),
                ("eps", self.eps), ("weight_decay", self.weight_decay))

    def torch_optimizer(self, params) -> torch.optim.Optimizer:
        """The eager equivalent, for reference runs."""
        if self.kind == OptimizerKind.SGD:
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                                   weight_decay=self.weight_decay, foreach=None)
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                 weight_decay=self.weight_decay, foreach=None)


def slot_meta_shape(slot: str, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    return () if slot == "step" else param_shape

