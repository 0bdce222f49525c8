"""Learning-rate schedules: meshplan's closed forms (`ir/lr_schedule.py`)
equal torch's own scheduler classes step by step, which verify's reference
runs (`autodiff/optimizer.py: torch_scheduler`)."""

from __future__ import annotations

import warnings

import pytest
import torch

from meshplan.autodiff.optimizer import OptimizerConfig, torch_optimizer, torch_scheduler
from meshplan.errors import ConfigError
from meshplan.ir.lr_schedule import LrSchedule

STEPS = 40


def torch_rates(cfg: OptimizerConfig, steps: int) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch_optimizer(cfg, [("w", p)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sched = torch_scheduler(cfg, opt)
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            if sched is not None:
                sched.step()
    return out


CASES = {
    "constant after warmup": LrSchedule("constant", warmup_steps=5),
    "linear": LrSchedule("linear", warmup_steps=3, decay_steps=20, min_lr=1e-3),
    "linear to zero": LrSchedule("linear", warmup_steps=0, decay_steps=STEPS),
    "cosine": LrSchedule("cosine", warmup_steps=4, decay_steps=25, min_lr=5e-4),
    "cosine, the run's length": LrSchedule("cosine", warmup_steps=2, total_steps=STEPS),
    "wsd": LrSchedule("wsd", warmup_steps=5, decay_steps=10, min_lr=1e-4, total_steps=STEPS),
}


@pytest.mark.parametrize("name", CASES)
def test_each_schedule_is_torchs(name):
    cfg = OptimizerConfig.of("adamw", lr=1e-2, lr_schedule=CASES[name])
    s = cfg.lr_schedule.resolved(cfg.lr)
    ours = [s.lr_at(cfg.lr, k) for k in range(STEPS)]
    theirs = torch_rates(cfg, STEPS)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15), name
    assert len(set(ours)) > 1  # it does move


def test_the_formulas_people_know():
    s = LrSchedule("cosine", warmup_steps=4, decay_steps=10, min_lr=0.0)
    assert s.lr_at(1.0, 0) == pytest.approx(1 / 5)        # warmup starts above zero
    assert s.lr_at(1.0, 4) == 1.0                          # the peak, after warmup
    assert s.lr_at(1.0, 9) == pytest.approx(0.5)           # half way down the cosine
    assert s.lr_at(1.0, 14) == 0.0 == s.lr_at(1.0, 99)     # held at min_lr
    wsd = LrSchedule("wsd", warmup_steps=0, decay_steps=4, total_steps=10).resolved(1.0)
    assert [wsd.lr_at(1.0, k) for k in range(10)] == pytest.approx(
        [1, 1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25])


@pytest.mark.parametrize("schedule, match", [
    (LrSchedule("cosine"), "needs --decay-steps"),
    (LrSchedule("wsd", decay_steps=5), "needs the run's steps"),
    (LrSchedule("linear", decay_steps=5, min_lr=1.0), "min_lr 1 is above"),
])
def test_a_schedule_that_cannot_work_is_one_line(schedule, match):
    with pytest.raises(ConfigError, match=match):
        schedule.resolved(0.1)


def test_the_schedule_travels_in_the_job_meta():
    s = LrSchedule("wsd", 2, 3, 1e-4, 10)
    assert LrSchedule.from_meta(s.to_meta(0.5)) == (s, 0.5)
