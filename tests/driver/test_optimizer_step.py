"""The optimizer step people run (issue 30): clipping, schedules, weight-decay
groups and the non-finite guard, judged by verify against torch's own
`clip_grad_norm_`, scheduler classes and parameter groups."""

from __future__ import annotations

import pytest

from meshplan.autodiff import OptimizerConfig
from meshplan.driver import reference
from meshplan.driver.job_report import report
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.run import run
from meshplan.driver.verify import verify
from meshplan.errors import TrainingHalted
from meshplan.ir.lr_schedule import LrSchedule
from meshplan.ir.mesh import Mesh
from meshplan.models import build_model, model_config

RECIPE = OptimizerConfig.of("adamw", max_grad_norm=1.0,
                            lr_schedule=LrSchedule("cosine", warmup_steps=2, total_steps=5))


def test_the_recipe_on_one_rank_equals_torch():
    r = verify("gpt", "tiny", steps=5, optimizer=RECIPE)
    assert r.ok, r.problems
    norms, ref = r.details["grad_norms"], r.details["ref_grad_norms"]
    assert len(norms) == len(ref) == 5 and all(n > 1.0 for n in ref)  # every step clips
    assert r.details["grad_norm_max_rel_diff"] <= 1e-5


def test_a_threshold_every_step_clips_hard_still_equals_torch():
    """At 1e-3 the factor is ~2e-4: wrong factors, not only wrong norms, show."""
    opt = OptimizerConfig.of("sgd", max_grad_norm=1e-3)
    s = zoo_strategy("gpt", model_config("gpt", "tiny"), dp=2, global_batch_size=8)
    r = verify("gpt", "tiny", steps=3, optimizer=opt, mesh=Mesh(1, 2), strategy=s)
    assert r.ok, r.problems


def test_a_schedule_meshplan_got_wrong_fails_verify(monkeypatch):
    """Planted: the runtime forgets the warmup. verify's reference is torch's
    LinearLR / CosineAnnealingLR, so the losses part."""
    real = LrSchedule.lr_at

    def no_warmup(self, base, step):
        return real(self, base, step + self.warmup_steps)

    monkeypatch.setattr(LrSchedule, "lr_at", no_warmup)
    r = verify("gpt", "tiny", steps=4, optimizer=RECIPE)
    assert not r.ok


def test_weight_decay_groups_are_torchs_param_groups(monkeypatch):
    """By default 1-D parameters take no decay, in both runs. Planted: the
    reference decays everything (one group): verify fails."""
    opt = OptimizerConfig.of("adamw", weight_decay=0.1)
    assert verify("gpt", "tiny", steps=4, optimizer=opt).ok
    assert verify("gpt", "tiny", steps=4, optimizer=OptimizerConfig.of(opt, no_decay="none")).ok
    assert verify("gpt", "tiny", steps=4,
                  optimizer=OptimizerConfig.of(opt, no_decay=r"ln_f|\.bias$")).ok
    monkeypatch.setattr(OptimizerConfig, "decays", lambda self, name, shape: True)
    bad = verify("gpt", "tiny", steps=4, optimizer=opt)
    monkeypatch.undo()
    assert bad.ok  # both sides read decays: patched alike, still equal
    real = reference.torch_optimizer

    def one_group(cfg, module):
        return real(OptimizerConfig.of(cfg, no_decay="none"), module)

    monkeypatch.setattr(reference, "torch_optimizer", one_group)
    assert not verify("gpt", "tiny", steps=4, optimizer=opt).ok


def test_plan_counts_each_decay_group():
    cfg = model_config("gpt", "tiny")
    module = build_model(cfg)
    one_d = [p for p in module.parameters() if p.ndim < 2]
    s = zoo_strategy("gpt", cfg, global_batch_size=8)
    groups = report(plan_model("gpt", "tiny", Mesh(1, 1), s, "adamw").job).optimizer
    wd = groups["weight_decay_groups"]
    assert wd["no_decay"] == {"params": len(one_d), "elements": sum(p.numel() for p in one_d)}
    assert wd["decay"]["params"] == len(list(module.parameters())) - len(one_d)
    every = report(plan_model("gpt", "tiny", Mesh(1, 1), s,
                              OptimizerConfig.of("adamw", no_decay="none")).job).optimizer
    assert every["weight_decay_groups"]["no_decay"]["params"] == 0


HUGE = dict(lr=1e30, max_grad_norm=1.0)


def test_halt_stops_with_one_line_naming_the_step():
    s = zoo_strategy("gpt", model_config("gpt", "tiny"), dp=2, global_batch_size=8)
    with pytest.raises(TrainingHalted, match=r"^step 1: the loss is nan and the gradient "
                       r"norm is nan; stopped before applying it"):
        run("gpt", "tiny", Mesh(1, 2), s, steps=3, optimizer=OptimizerConfig.of("sgd", **HUGE))
    with pytest.raises(TrainingHalted, match="^step 1: "):
        verify("gpt", "tiny", steps=3, optimizer=OptimizerConfig.of("sgd", **HUGE))


@pytest.mark.parametrize("zero", [0, 1])
def test_skip_goes_on_and_reports_each_skipped_step(zero):
    """Every rank skips alike: at ZeRO 1 the step's gathers are skipped too."""
    s = zoo_strategy("gpt", model_config("gpt", "tiny"), dp=2, zero=zero, global_batch_size=8)
    opt = OptimizerConfig.of("sgd", on_nonfinite="skip", **HUGE)
    r = run("gpt", "tiny", Mesh(1, 2), s, steps=4, optimizer=opt)
    assert r.skipped_steps == [1, 2, 3] and len(r.losses) == 4


def test_the_guard_without_clipping_computes_the_norm_only():
    opt = OptimizerConfig.of("sgd", on_nonfinite="skip")
    r = verify("gpt", "tiny", steps=2, optimizer=opt)
    assert r.ok and len(r.details["grad_norms"]) == len(r.details["ref_grad_norms"]) == 2
