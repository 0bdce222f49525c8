"""Issue 30's "done when": verify passes with `--clip-grad-norm 1.0
--lr-schedule cosine --warmup-steps 2 --optimizer adamw` on losses, every
parameter, every optimizer slot and the gradient norm at each step (1e-5
relative in fp32, against torch's `clip_grad_norm_`), at every layout the
issue names. Three fast cases; the rest are slow (CI runs them)."""

from __future__ import annotations

import pytest

from meshplan.autodiff import OptimizerConfig
from meshplan.driver.plan import zoo_strategy
from meshplan.driver.verify import verify
from meshplan.ir.lr_schedule import LrSchedule
from meshplan.ir.mesh import Mesh
from meshplan.models import model_config

STEPS = 4
RECIPE = OptimizerConfig.of("adamw", max_grad_norm=1.0,
                            lr_schedule=LrSchedule("cosine", warmup_steps=2,
                                                   total_steps=STEPS))
GPT = {  # name: (strategy fields, model overrides, precision)
    "1rank": ({}, {}, "fp32"),
    "dp2": (dict(dp=2), {}, "fp32"),
    "tp2": (dict(tp=2), {}, "fp32"),
    "pp2·vpp2": (dict(pp=2, vpp=2, micro_batch_size=2, schedule="interleaved"), {}, "fp32"),
    "dp2·tp2·pp2·vpp2": (dict(dp=2, tp=2, pp=2, vpp=2, micro_batch_size=1,
                               schedule="interleaved"), {}, "fp32"),
    "zb1p": (dict(pp=2, micro_batch_size=2, schedule="zb1p"), {}, "fp32"),
    "zbv": (dict(pp=2, vpp=2, micro_batch_size=2, schedule="zbv"), {}, "fp32"),
    "zero1 dp4": (dict(dp=4, zero=1), {}, "fp32"),
    "zero2 dp4": (dict(dp=4, zero=2), {}, "fp32"),
    "zero3 dp4": (dict(dp=4, zero=3), {}, "fp32"),
    "tied tp2·pp2": (dict(tp=2, pp=2, micro_batch_size=2), {"tie_embeddings": True}, "fp32"),
    "bf16 dp2·tp2·pp2": (dict(dp=2, tp=2, pp=2, micro_batch_size=1), {}, "bf16"),
    "fp16 dp2·tp2·pp2": (dict(dp=2, tp=2, pp=2, micro_batch_size=1), {}, "fp16"),
}
HF = ("hf:gpt2", "hf:bert", "hf:llama")
FAST = {"tp2", "pp2·vpp2", "tied tp2·pp2"}


def _verify(model: str, fields: dict, overrides: dict, precision: str = "fp32",
            optimizer: OptimizerConfig = RECIPE):
    cfg = model_config(model, "tiny", **overrides)
    s = zoo_strategy(model, cfg, global_batch_size=8, precision=precision, **fields)
    return verify(model, "tiny", steps=STEPS, optimizer=optimizer, strategy=s,
                  mesh=Mesh(1, s.dp * s.tp * s.pp), **overrides)


def _judged(r) -> None:
    assert r.ok, r.problems
    norms, ref = r.details["grad_norms"], r.details["ref_grad_norms"]
    assert len(norms) == len(ref) == STEPS and max(ref) > 1.0  # the threshold binds
    assert r.details["grad_norm_max_rel_diff"] <= r.details["bounds"]["rtol"]


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in GPT])
def test_gpt_tiny_recipe_equals_torch(name):
    fields, overrides, precision = GPT[name]
    _judged(_verify("gpt", fields, overrides, precision))


@pytest.mark.slow
@pytest.mark.parametrize("model", HF)
def test_transformers_recipe_equals_torch_at_tp2_pp2(model):
    _judged(_verify(model, dict(tp=2, pp=2, micro_batch_size=2), {}))


@pytest.mark.slow
def test_every_step_clipped_hard_equals_torch_at_dp2_tp2_pp2_vpp2():
    """At 1e-3 every step's factor is ~3e-4: the factor itself is tested."""
    hard = OptimizerConfig.of(RECIPE, max_grad_norm=1e-3)
    r = _verify("gpt", GPT["dp2·tp2·pp2·vpp2"][0], {}, optimizer=hard)
    _judged(r)
    assert min(r.details["ref_grad_norms"]) > 1.0
