"""fp16 dynamic loss scaling, torch.amp.GradScaler's rule.

Invariant: the scale is a step-level state every rank holds (and
checkpoints) as `LOSS_SCALE`; the backward seed is multiplied by it. It
starts at the train step's `TrainFacts.loss_scale` (else `INIT_SCALE`), halves on
a step whose gradients overflow (the step is skipped) and doubles after
`GROWTH_INTERVAL` good steps in a row.
"""

from __future__ import annotations

INIT_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000


def initial_loss_scale(facts) -> float:
    """The fp16 loss scale a run starts at (`GraphFacts.train.loss_scale`)."""
    train = facts.train
    return INIT_SCALE if train is None or train.loss_scale is None else train.loss_scale


def next_scale(scale: float, good_steps: int, overflow: bool) -> tuple[float, int]:
    """The scale and the count of good steps in a row after a step."""
    good_steps = 0 if overflow else good_steps + 1
    if overflow or good_steps == GROWTH_INTERVAL:
        return scale * (0.5 if overflow else 2.0), 0
    return scale, good_steps
