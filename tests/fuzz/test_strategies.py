"""Fuzz: random strategies over random world sizes and layer counts.

Each drawn (mesh, strategy, GPT layer count) either plans, lowers every rank
and passes `check_plans` (ids, send/recv, collective order, simulation), or
is refused with a user error (`ConfigError`, `ScheduleError`): never an
internal `PlanError` or another exception, never a hang. The
default profile draws a few examples, derandomized so CI is repeatable; the
slow variant draws many more.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.errors import ConfigError, ScheduleError
from meshplan.ir.mesh import Mesh
from meshplan.lowering.check import check_plans
from meshplan.lowering.lower import lower
from meshplan.models import model_config

COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
FAST = settings(max_examples=8, derandomize=True, **COMMON)
SLOW = settings(max_examples=150, **COMMON)


@st.composite
def setups(draw):
    """(mesh, strategy fields, layers): mostly consistent, sometimes not."""
    dp, tp, pp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4])), \
        draw(st.integers(1, 4))
    world = dp * tp * pp
    if draw(st.integers(0, 5)) == 0:  # a mesh that does not fit the product
        world = draw(st.integers(1, 8))
    dpn = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    vpp = draw(st.sampled_from([1, 1, 2, 3]))
    fits = draw(st.integers(0, 4)) > 0  # mostly counts that divide: more plans get made
    m = pp * draw(st.integers(1, 3)) if fits else draw(st.integers(1, 8))
    mbs = draw(st.integers(1, 2))
    gbs = m * mbs * dp if draw(st.integers(0, 5)) else draw(st.integers(1, 16))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    layers = pp * vpp * draw(st.integers(1, 2)) if fits else draw(st.integers(1, 8))
    fields = dict(dp=dp, tp=tp, pp=pp, vpp=vpp, global_batch_size=gbs,
                  micro_batch_size=mbs, schedule=schedule)
    return Mesh(world // dpn, dpn), fields, layers


def plan_or_refuse(mesh: Mesh, fields: dict, layers: int) -> str:
    """'ok' when every rank lowered and checked, else the error class."""
    try:
        cfg = model_config("gpt", "tiny", layers=layers)
        job = plan_model("gpt", "tiny", mesh, zoo_strategy("gpt", cfg, **fields),
                         layers=layers).job
        plans = {r: lower(job, r) for r in range(mesh.world)}
    except (ConfigError, ScheduleError) as e:  # a PlanError is a bug: it propagates
        assert "\n" not in str(e), str(e)
        return type(e).__name__
    res = check_plans(job, plans)
    assert res.ok, res.errors[:3]
    assert math.isfinite(res.predicted_step_s) and res.bubble_ratio >= 0
    return "ok"


@pytest.mark.timeout(300)
@FAST
@given(setups())
def test_a_strategy_plans_or_is_refused(setup):
    event(plan_or_refuse(*setup))


@pytest.mark.slow
@pytest.mark.timeout(900)
@SLOW
@given(setups())
def test_a_strategy_plans_or_is_refused_many(setup):
    event(plan_or_refuse(*setup))


def test_both_outcomes_are_drawn():
    """The generator is not degenerate: it reaches plans and refusals."""
    got = {plan_or_refuse(Mesh(1, 4), dict(dp=1, tp=2, pp=2, vpp=1, global_batch_size=4,
                                          micro_batch_size=1, schedule="1f1b"), 2),
           plan_or_refuse(Mesh(1, 4), dict(dp=1, tp=2, pp=2, vpp=2, global_batch_size=4,
                                          micro_batch_size=1, schedule="1f1b"), 3)}
    assert got == {"ok", "ConfigError"}
