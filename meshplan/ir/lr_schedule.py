"""Learning-rate schedules: the rate of each step, a pure function of the step.

    warmup (k < W):  lr * (k + 1) / (W + 1)          torch's LinearLR(1/(W+1) -> 1, W)
    then, j = k - W:
      constant       lr
      linear         lr * (1 + (min_lr/lr - 1) * min(j, D) / D)
      cosine         min_lr + (lr - min_lr) * (1 + cos(pi * min(j, D) / D)) / 2
      wsd            lr for the first S = total - W - D steps, then linear to min_lr
                     over the last D

(W warmup_steps, D decay_steps). Past its decay a schedule stays at min_lr.
Each is the formula torch users know; verify's reference runs torch's own
scheduler classes (`autodiff/optimizer.py: torch_scheduler`), not these.

Invariant: the Job carries the schedule (`TrainFacts.lr_schedule`, with the
base rate); the optimizer ops read the state LR, which the runtime sets
from `lr_at(STEP_COUNT)` before each STEP, so the plan is the same at every
step, and a checkpoint (which holds both states) resumes the schedule.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from meshplan.errors import ConfigError
from meshplan.ir.choices import LrScheduleKind, choose


@dataclass(frozen=True, slots=True)
class LrSchedule:
    kind: LrScheduleKind = LrScheduleKind.CONSTANT
    warmup_steps: int = 0
    decay_steps: int | None = None   # linear, cosine, wsd: None = to the run's end
    min_lr: float = 0.0
    total_steps: int | None = None   # the run's steps (wsd needs them)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", choose(LrScheduleKind, self.kind, "lr schedule"))
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup steps {self.warmup_steps} must be >= 0")
        if self.min_lr < 0:
            raise ConfigError(f"min_lr {self.min_lr} must be >= 0")

    @property
    def scheduled(self) -> bool:
        """Whether the rate changes at all (else the optimizer takes a constant)."""
        return self.kind != LrScheduleKind.CONSTANT or self.warmup_steps > 0

    def resolved(self, base_lr: float) -> LrSchedule:
        """This schedule with its decay length fixed and checked against
        `base_lr`; a bad one is one ConfigError line."""
        if not self.scheduled or self.kind == LrScheduleKind.CONSTANT:
            return self
        if self.min_lr > base_lr:
            raise ConfigError(f"min_lr {self.min_lr:g} is above the learning rate "
                              f"{base_lr:g}; give --min-lr below --lr")
        decay = self.decay_steps
        if decay is None and self.total_steps is not None:
            decay = self.total_steps - self.warmup_steps
        if decay is None or decay < 1:
            raise ConfigError(f"the {self.kind} schedule needs --decay-steps >= 1 (or "
                              f"--steps above --warmup-steps {self.warmup_steps})")
        if self.kind == LrScheduleKind.WSD and (
                self.total_steps is None or self.total_steps < self.warmup_steps + decay):
            raise ConfigError(f"the wsd schedule decays over the last {decay} steps of the run: "
                              f"it needs the run's steps (--steps) >= warmup {self.warmup_steps}"
                              f" + decay {decay}")
        return LrSchedule(self.kind, self.warmup_steps, decay, self.min_lr, self.total_steps)

    def lr_at(self, base_lr: float, step: int) -> float:
        """The rate of step `step` (0-based)."""
        w = self.warmup_steps
        if step < w:
            return base_lr * (step + 1) / (w + 1)
        j = step - w
        if self.kind == LrScheduleKind.CONSTANT:
            return base_lr
        d = self.decay_steps
        assert d is not None, "resolved() fixes the decay"
        if self.kind == LrScheduleKind.WSD:
            assert self.total_steps is not None
            stable = self.total_steps - w - d
            if j < stable:
                return base_lr
            j -= stable
        t = min(j, d) / d
        if self.kind == LrScheduleKind.COSINE:
            return self.min_lr + (base_lr - self.min_lr) * (1 + math.cos(math.pi * t)) / 2
        return base_lr * (1 + (self.min_lr / base_lr - 1) * t)

    def to_meta(self, base_lr: float) -> str:
        return json.dumps({**asdict(self), "kind": str(self.kind), "lr": base_lr})

    @staticmethod
    def from_meta(text: str) -> tuple[LrSchedule, float]:
        d = json.loads(text)
        lr = d.pop("lr")
        return LrSchedule(**d), lr
