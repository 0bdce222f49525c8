"""passes/derive.py: derived plans from what capture recorded. transformers'
own tp plan with each inexact style noted; GQA key/value heads that tp does
not divide are replicated (and still train as eager)."""

from __future__ import annotations

import copy

import pytest
import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import against_eager
from meshplan.ir.mesh import Mesh
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime.local import run_local

pytest.importorskip("transformers")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/models/test_hf.py
    yield
    torch.set_num_threads(before)


def test_gqa_heads_tp_does_not_divide_are_replicated_and_train_as_eager(one_thread):
    cfg = model_config("hf:llama", "tiny")  # 4 heads, 2 key/value heads
    s = zoo_strategy("hf:llama", cfg, tp=4, global_batch_size=4, micro_batch_size=4)
    job = plan_model("hf:llama", "tiny", Mesh(1, 4), s).job
    plan = dict(job.strategy.tp_plan)
    assert plan[r"model\.model\.layers\.\d+\.self_attn\.q_proj"] == "colwise"
    assert plan[r"model\.model\.layers\.\d+\.self_attn\.k_proj"] == "replicate"
    assert any("2 key/value heads do not split over tp=4; replicated" in n for n in job.notes)
    assert any("'colwise_gather_output' mapped to 'vocab'" in n for n in job.notes)
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, 4, seed=i) for i in range(3)]
    run = run_local(job, copy.deepcopy(module), batches)
    verdict, _ = against_eager(run.rank_losses, run.slices, module, batches, 1,
                               OptimizerConfig.default("sgd"))
    assert verdict["ok"], verdict["problems"]
