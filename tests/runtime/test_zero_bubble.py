"""Zero-bubble schedules end to end: the backward split at compile time, run
as separate I and W actions, equal to eager PyTorch in losses and every
parameter and optimizer slot (fp32); and the check's proof of the split
fails on planted bugs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import verify
from meshplan.ir import Phase
from meshplan.ir.mesh import Mesh
from meshplan.lowering.check import check_plans
from meshplan.lowering.lower import lower
from meshplan.models import model_config
from meshplan.schedules.action import ActionType

TOL = 1e-5
CASES = {  # name: (model, ranks, strategy fields)
    "gpt-zb1p": ("gpt", 2, dict(pp=2, vpp=2, schedule="zb1p")),
    "gpt-zbv": ("gpt", 2, dict(pp=2, vpp=2, schedule="zbv")),
    "bert-zb1p": ("bert", 2, dict(pp=2, vpp=2, schedule="zb1p")),
    "bert-zbv": ("bert", 2, dict(pp=2, vpp=2, schedule="zbv")),
    "gpt-dp2-zbv": ("gpt", 4, dict(dp=2, pp=2, vpp=2, schedule="zbv")),
}


def _strategy(model: str, **fields):
    fields = {"global_batch_size": 8 * fields.get("dp", 1), "micro_batch_size": 2} | fields
    return zoo_strategy(model, model_config(model, "tiny"), **fields)


def _plans(model: str, ranks: int, **fields):
    job = plan_model(model, "tiny", Mesh(1, ranks), _strategy(model, **fields)).job
    return job, {r: lower(job, r) for r in range(ranks)}


@pytest.mark.parametrize("name", CASES)
def test_equal_to_eager_in_losses_and_parameters(name):
    model, ranks, fields = CASES[name]
    r = verify(model, "tiny", steps=6, mesh=Mesh(1, ranks), strategy=_strategy(model, **fields))
    assert r["ok"], r["problems"]  # every loss-holding rank, parameter and optimizer slot
    assert r["max_abs_diff"] <= TOL, (r["losses"], r["ref_losses"])
    assert r["params"] and r["optimizer_state"]


@pytest.mark.parametrize("schedule", ["zb1p", "zbv"])
def test_the_split_is_real_and_w_is_deferred(schedule):
    job, plans = _plans("gpt", 2, pp=2, vpp=2, schedule=schedule)
    phases = {op.phase for op in job.graph.ops}
    assert Phase.WEIGHT in phases and Phase.BACKWARD in phases
    for p in plans.values():
        kinds = [a.type for a in p.actions if a.type.is_compute]
        assert ActionType.B not in kinds and kinds.count(ActionType.I) == kinds.count(ActionType.W)
        # some W runs after an action other than its own I: deferred to fill a bubble
        pairs = list(zip(p.actions, p.actions[1:]))
        assert any(a.type is ActionType.I and b.type is not ActionType.W for a, b in pairs)
    assert check_plans(job, plans).ok


def test_b_schedules_keep_one_backward():
    job, _ = _plans("gpt", 2, pp=2, vpp=2, schedule="interleaved")
    assert Phase.WEIGHT not in {op.phase for op in job.graph.ops}


def test_check_catches_an_input_gradient_left_in_w(monkeypatch):
    """Planted: the split puts every backward op in W; the gradient sent to
    the previous stage is then written by the weight phase."""
    import meshplan.autodiff.split as split

    monkeypatch.setattr(split, "input_grad_ops", lambda graph, place: set())
    job, plans = _plans("gpt", 2, pp=2, vpp=2, schedule="zb1p")
    res = check_plans(job, plans)
    assert not res.ok
    assert any("that the weight phase writes; I and F must not wait for W" in e
               for e in res.errors), res.errors


def test_check_catches_a_deferred_value_without_its_slots():
    """Planted: one buffer that lives until a deferred W loses a slot."""
    job, plans = _plans("gpt", 2, pp=2, vpp=2, schedule="zbv")
    p = plans[0]
    weight_tasks = {t.id for t in p.tasks if t.phase is Phase.WEIGHT}
    victim = next(b for b in p.buffers if b.copies > 1 and weight_tasks & set(b.consumers))
    buffers = tuple(replace(b, copies=b.copies - 1) if b is victim else b for b in p.buffers)
    res = check_plans(job, plans | {0: replace(p, buffers=buffers)})
    assert any(f"buffer {victim.id} (value {victim.value}) has {victim.copies - 1} slot(s)" in e
               for e in res.errors), res.errors
