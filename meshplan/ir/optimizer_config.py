"""The optimizer's configuration: hyperparameters with torch.optim's names
and meanings, the train step's fact (`TrainFacts.optimizer_config`).

Invariant: `from_json(c.to_json()) == c`, and `to_json` is deterministic
(a Job's facts hold it; `ir/serialize.py` refuses what would not write back
the same text). The eager equivalents, torch's optimizer and schedulers,
are built from it in `autodiff/optimizer.py`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from meshplan.errors import ConfigError
from meshplan.ir.choices import NonFinite, OptimizerKind, choose
from meshplan.ir.lr_schedule import LrSchedule


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
    # the rate of each step (ir/lr_schedule.py); the default: `lr` at every step
    lr_schedule: LrSchedule = LrSchedule()
    # parameters without weight decay: "" the 1-D ones (biases, norm weights, as
    # Megatron and LiBai), "none" none, else a regex searched in parameter names
    no_decay: str = ""
    # a step whose gradient norm is inf/nan: halt or skip (None: halt when the
    # norm is computed, i.e. with clipping; a choice computes the norm anyway)
    on_nonfinite: NonFinite | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", choose(OptimizerKind, self.kind, "optimizer"))
        if self.on_nonfinite is not None:
            object.__setattr__(self, "on_nonfinite",
                               choose(NonFinite, self.on_nonfinite, "--on-nonfinite"))
        if self.no_decay not in ("", "none"):
            try:
                re.compile(self.no_decay)
            except re.error as e:
                raise ConfigError(f"--no-decay '{self.no_decay}' is not a regex ({e}); give "
                                  "one over parameter names, e.g. 'bias|norm'") from None
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
            cfg = OptimizerConfig(choose(OptimizerKind, kind, "optimizer"))
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

    def to_json(self) -> str:
        """This config as JSON (how `ir/serialize.py` writes a train step's facts)."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["lr_schedule"] = {f: getattr(self.lr_schedule, f)
                            for f in self.lr_schedule.__dataclass_fields__}
        return json.dumps(d)

    @staticmethod
    def from_json(text: str) -> OptimizerConfig:
        d = json.loads(text)
        d["betas"] = tuple(d["betas"])
        d["lr_schedule"] = LrSchedule(**d["lr_schedule"])
        return OptimizerConfig(**d)

    @staticmethod
    def of_job(job) -> OptimizerConfig:
        """The config the Job's train step was built with (its facts)."""
        train = job.graph.facts.train
        if train is None:
            raise ConfigError("the Job has no optimizer op; plan it from a captured graph")
        return train.optimizer_config

    @property
    def guard(self) -> NonFinite | None:
        """What a non-finite gradient norm does, when the norm is computed."""
        if self.on_nonfinite is not None:
            return self.on_nonfinite
        return NonFinite.HALT if self.max_grad_norm is not None else None

    def decays(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether parameter `name` of `shape` takes weight decay (`no_decay`)."""
        if self.no_decay == "none":
            return True
        if self.no_decay == "":
            return len(shape) >= 2
        return re.search(self.no_decay, name) is None
