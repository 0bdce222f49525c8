"""runtime/local.py: every rank on a thread gives eager's losses, and a wait
that can never be met ends in a RuntimeFault instead of a hang."""

from __future__ import annotations

import time

import pytest
import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import against_eager
from meshplan.errors import RuntimeFault
from meshplan.ir.mesh import Mesh
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime.local import Hub, run_local


@pytest.mark.parametrize("fields, world", [
    (dict(tp=2, pp=2, global_batch_size=8, micro_batch_size=2), 4),
    (dict(dp=2, tp=2, global_batch_size=8, micro_batch_size=2), 4),
])
def test_local_ranks_match_eager(fields, world):
    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, **fields)
    job = plan_model("gpt", "tiny", Mesh(1, world), s).job
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, 8, seed=i) for i in range(3)]
    mine = run_local(job, module, batches)
    verdict, _ = against_eager(mine.rank_losses, mine.slices, module, batches,
                               s.num_microbatches, OptimizerConfig.default("sgd"))
    assert verdict["ok"], verdict["problems"]
    assert len(verdict["params"]) == len(dict(module.named_parameters()))


def test_a_wait_that_cannot_be_met_is_bounded():
    hub = Hub(timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(RuntimeFault, match="waited 0 s for a message"):
        hub.take((0, 1, 7))
    with pytest.raises(RuntimeFault, match="stopped"):  # every later wait fails at once
        hub.exchange(("g", 1), (0, 1), 0, torch.zeros(1))
    assert time.monotonic() - t0 < 2
