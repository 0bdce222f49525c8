"""Models with dropout at 0.1 verify equal to eager PyTorch drawing the same
masks (`driver/same_masks.py`), fp32 within verify's bounds, losses and every
parameter, at every layout of issue 36: the README's classifier with a
dropout in each block, BERT tiny (attention dropout too) and transformers'
GPT-2 (GPT tiny: tests/runtime/test_random_layouts.py). The ranks run on
threads (`runtime/local.py`); one run goes through `meshplan verify`'s
processes, where the seed travels in the RunSpec."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshplan.api as mp
from meshplan.autodiff import OptimizerConfig
from meshplan.cli.main import main
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import against_eager
from meshplan.ir.mesh import Mesh
from meshplan.models import build_model, example_batch, model_config
from meshplan.ops.rule import Category
from meshplan.ops.table import rule_for
from meshplan.runtime.local import run_local
from tests.runtime.test_random_layouts import BATCH, LAYOUTS, M

P = 0.1


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(P)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.relu(self.fc1(x))))


class Classifier(nn.Module):
    """The README's classifier with `nn.Dropout(0.1)` in every block."""

    def __init__(self, width=32, classes=10, layers=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x), y)


TP_PLAN = ((r"blocks\.\d+\.fc1", "colwise"), (r"blocks\.\d+\.fc2", "rowwise"))


def _verdict(job, module, batches) -> dict:
    mine = run_local(job, module, batches)
    verdict, _ = against_eager(mine.rank_losses, mine.slices, module, batches, M,
                               OptimizerConfig.of_job(job))
    assert len(verdict["params"]) == len(dict(module.named_parameters()))
    return verdict


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_classifier_with_dropout(layout):
    fields, world = LAYOUTS[layout]
    torch.manual_seed(0)
    model = Classifier()
    batches = [(torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))) for _ in range(3)]
    rows = fields["micro_batch_size"] * fields.get("dp", 1)
    graph = mp.capture(model, (batches[0][0][:rows], batches[0][1][:rows]))
    extra = {"tp_plan": TP_PLAN} if fields.get("tp", 1) > 1 else {}
    strategy = mp.Strategy(global_batch_size=BATCH, layer_pattern=r"blocks\.(\d+)",
                           recompute_pattern=r"blocks\.\d+", **fields, **extra)
    job = mp.plan(graph, mp.Mesh(1, world), strategy, optimizer="adamw", lr=1e-3)
    verdict = _verdict(job, model, batches)
    assert verdict["ok"], verdict["problems"]


@pytest.mark.parametrize("model", ["bert", "hf:gpt2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zoo_and_transformers_with_dropout(model, layout):
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    fields, world = LAYOUTS[layout]
    cfg = model_config(model, "tiny", dropout=P)
    strategy = zoo_strategy(model, cfg, global_batch_size=BATCH, **fields)
    job = plan_model(model, "tiny", Mesh(1, world), strategy, dropout=P).job
    assert any(op.kind == "meshplan.dropout" for op in job.graph.ops)
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, BATCH, seed=i) for i in range(3)]
    verdict = _verdict(job, module, batches)
    assert verdict["ok"], verdict["problems"]


def test_verify_command_with_dropout_on_processes(capsys):
    """`meshplan verify` at dp2·tp2·pp2·vpp2 with dropout: every rank gets the
    seed through its RunSpec and draws the eager reference's masks."""
    code = main(["verify", "--model", "gpt", "--dropout", "0.1", "--steps", "2", "--seed", "3",
                 "--devices-per-node", "8", "--tp", "2", "--pp", "2", "--vpp", "2",
                 "--num-microbatches", "4", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert '"ok": true' in out


@pytest.mark.parametrize("model", ["gpt", "hf:llama"])
def test_dropout_adds_no_collective_at_tp2(model):
    """Dropout's masks are drawn where the values live: the tp plan with
    dropout (attention's as aten ops, with exact rules) makes exactly the
    collectives of the plan without."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")

    def collectives(p: float):
        cfg = model_config(model, "tiny", dropout=p)
        s = zoo_strategy(model, cfg, tp=2, global_batch_size=8, micro_batch_size=8)
        job = plan_model(model, "tiny", Mesh(1, 2), s, dropout=p).job
        return sorted((op.kind, op.phase.name) for op in job.graph.ops
                      if rule_for(op.kind).category is Category.COLLECTIVE)

    assert collectives(0.1) == collectives(0.0)
