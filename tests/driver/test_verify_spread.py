"""verify against stock PyTorch's own random numbers (`--reference-rng
torch`): a dropout model's 20-step loss curve at dp2·tp2 lies within the
run-to-run spread of eager runs with other seeds (`compare.spread_verdict`,
docs/concepts/verify.md), and the check catches a wrong dropout."""

from __future__ import annotations

import pytest
import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.driver.compare import spread_verdict
from meshplan.driver.plan import zoo_strategy
from meshplan.driver.reference import eager_train
from meshplan.driver.same_masks import SameMasks
from meshplan.driver.verify import verify
from meshplan.ir.mesh import Mesh
from meshplan.models import build_model, example_batch, model_config

STEPS = 20


def test_dp2_tp2_with_dropout_is_within_stock_pytorch_spread():
    cfg = model_config("gpt", "tiny", dropout=0.1)
    s = zoo_strategy("gpt", cfg, dp=2, tp=2, global_batch_size=8, micro_batch_size=4)
    r = verify("gpt", "tiny", steps=STEPS, mesh=Mesh(1, 4), strategy=s, dropout=0.1,
               reference_rng="torch", ref_runs=5)
    assert r.ok, r.problems
    assert r.details["ref_runs"] == 5 and len(r.details["ref_curves"]) == 5
    assert r.params == {}  # other masks, other weights: not compared
    # the curves differ (other draws), by more than rounding
    assert max(abs(a - b) for a, b in zip(r.losses, r.ref_losses)) > 1e-4


def _curve(p: float, masks, seed: int = 0) -> list[float]:
    """Eager GPT tiny's losses, its masks drawn by `masks` or else torch's
    generator from `seed` (the weights are seed 0's either way)."""
    cfg = model_config("gpt", "tiny", dropout=p)
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, 8, seed=s) for s in range(STEPS)]
    torch.manual_seed(seed)
    return eager_train(module, batches, 1, OptimizerConfig.default("sgd"), masks=masks).losses


@pytest.fixture(scope="module")
def stock_runs():
    return [_curve(0.1, None, 10 + k) for k in range(5)]


def test_the_spread_check_catches_a_wrong_dropout(stock_runs):
    assert spread_verdict({"0": _curve(0.1, SameMasks(3))}, stock_runs)["ok"]
    for wrong in (0.0, 0.3):  # dropout missing, or at another probability
        v = spread_verdict({"0": _curve(wrong, SameMasks(3))}, stock_runs)
        assert not v["ok"] and "beyond their spread's 99.9% bound" in v["problems"][0]
