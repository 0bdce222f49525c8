"""Shared (tied) parameters: capture records every alias; across pipeline
stages every stage that reads one keeps a copy, the copies' gradients are
summed once per step and every copy takes the same update; trained at
every layout, losses and every parameter (each copy included) equal eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import meshplan.api as mp
from meshplan.autodiff import OptimizerConfig
from meshplan.capture import capture
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import against_eager
from meshplan.errors import ConfigError
from meshplan.ir import Phase
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.lowering.check import check_plans
from meshplan.lowering.lower import lower
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime.local import run_local

pytestmark = pytest.mark.usefixtures("one_torch_thread")


TIED = "wte.weight"


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.blocks[3].weight = self.blocks[0].weight

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.sum()


def test_capture_records_every_alias_and_one_input():
    g = capture(Chain(), (torch.randn(2, 4),))
    names = [g.values[v].name for v in g.inputs]
    assert "blocks.0.weight" in names and "blocks.3.weight" not in names
    assert g.aliases() == {"blocks.3.weight": "blocks.0.weight"}
    assert g.names_of("blocks.0.weight") == ("blocks.0.weight", "blocks.3.weight")


def test_zoo_gpt_ties_head_to_embedding():
    m = build_model(model_config("gpt", "tiny", tie_embeddings=True))
    assert m.head.weight is m.wte.weight
    assert len(list(m.parameters())) == len(list(build_model(model_config(
        "gpt", "tiny")).parameters())) - 1


# Default learning rates; see the note on AdamW in tests/models/test_hf.py.
LR = {"sgd": None, "adamw": None}


def _job(world: int, optimizer: str = "sgd", **fields):
    cfg = model_config("gpt", "tiny", tie_embeddings=True)
    s = zoo_strategy("gpt", cfg, global_batch_size=8, **fields)
    return cfg, plan_model("gpt", "tiny", Mesh(1, world), s, optimizer, LR[optimizer],
                           tie_embeddings=True).job


def test_each_stage_reading_it_keeps_a_copy_and_sums_once_per_step():
    _, job = _job(2, pp=2, micro_batch_size=2)
    g = job.graph
    opt = [op for op in g.ops if op.kind == "meshplan.sgd" and g.values[op.args[0].id].name == TIED]
    assert sorted(job.stage[op.id] for op in opt) == [0, 1]
    reduce = [op for op in g.ops if op.kind == "meshplan.all_reduce"
              and dict(op.kwargs).get("stages") == (0, 1)]
    assert len(reduce) == 2 and all(op.phase is Phase.OPTIMIZER for op in reduce)
    assert {op.args[1].id for op in opt} == {op.outputs[0] for op in reduce}
    # the gradient never travels per micro-batch: no transfer carries a grad of the weight
    grads = {op.outputs[0] for op in g.ops if op.kind == "meshplan.accumulate_grad"}
    assert not [op for op in g.ops if op.kind == "meshplan.transfer"
                and op.args[0].id in grads]


def _train(world, optimizer, steps=5, **fields):
    """Train the tied GPT at a layout beside eager; the verdict of
    `driver.verify` (losses, and every parameter and slot assembled from all
    ranks, the copies of the tied weight checked equal) and its copies."""
    cfg, job = _job(world, optimizer, **fields)
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, 8, seed=i) for i in range(steps)]
    run = run_local(job, copy.deepcopy(module), batches)
    verdict, _ = against_eager(run.rank_losses, run.slices, module, batches,
                               job.strategy.num_microbatches,
                               OptimizerConfig.default(optimizer, LR[optimizer]))
    copies = sum(k.startswith(TIED + "|") for s in run.slices.values() for k in s)
    return verdict, copies


LAYOUTS = {
    "1rank": (1, {}),
    "tp2": (2, dict(tp=2, micro_batch_size=4)),
    "pp2": (2, dict(pp=2, micro_batch_size=2)),
    "tp2pp2": (4, dict(tp=2, pp=2, micro_batch_size=2)),
}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tied_gpt_trains_as_eager(layout, optimizer):
    world, fields = LAYOUTS[layout]
    verdict, copies = _train(world, optimizer, **fields)
    assert verdict["ok"], verdict["problems"]
    assert verdict["max_abs_diff"] <= 1e-5
    assert TIED in verdict["params"] and "head.weight" not in verdict["params"]
    assert verdict["params"][TIED].get("replica_spread", 0.0) == 0.0
    tp, pp = fields.get("tp", 1), fields.get("pp", 1)
    assert copies == tp * pp  # a slice on every rank: every stage holds its copy


@pytest.mark.slow
def test_tied_gpt_dp2_tp2_pp2_vpp2_trains_as_eager():
    verdict, copies = _train(8, "adamw", dp=2, tp=2, pp=2, vpp=2, micro_batch_size=1,
                             schedule="interleaved")
    assert verdict["ok"], verdict["problems"]
    assert copies == 8


def test_weights_load_under_any_alias():
    from meshplan.runtime.state import own_tensor, weights_of

    m = Chain()
    g = capture(m, (torch.randn(2, 4),))
    assert {"blocks.0.weight", "blocks.3.weight"} <= set(weights_of(m))
    w = m.blocks[0].weight.detach()
    assert own_tensor({"blocks.3.weight": w}, g, "blocks.0.weight") is w  # the other name
    with pytest.raises(ConfigError, match="no parameter or buffer 'blocks.0.weight'"):
        own_tensor({}, g, "blocks.0.weight")


def test_derived_plans_on_the_zoo_gpt():
    cfg = model_config("gpt", "tiny", tie_embeddings=True)
    s = zoo_strategy("gpt", cfg, tp=2, pp=2, global_batch_size=8, micro_batch_size=2,
                     tp_plan="derived", layer_pattern="derived")
    job = plan_model("gpt", "tiny", Mesh(1, 4), s, tie_embeddings=True).job
    assert job.strategy.layer_pattern == r"blocks\.(\d+)"
    assert job.strategy.tp_plan == ((r"blocks\.\d+\.mlp\.fc1$", "colwise"),  # Megatron's
                                    (r"blocks\.\d+\.mlp\.fc2$", "rowwise"),  # MLP pair
                                    ("wte", "vocab"), ("head", "vocab"))
    assert any("tp_plan derived from structure" in n for n in job.notes)


class ReadTwice(nn.Module):
    """Stage 1 reads a stage-0 weight whole (a slice of it), where stage 0
    reads it as tensor parallelism splits it (rowwise: by columns)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(fc1=nn.Linear(8, 16), fc2=nn.Linear(16, 8)))
                                    for _ in range(4))

    def forward(self, x, y):
        for i, b in enumerate(self.blocks):
            x = x + b["fc2"](torch.tanh(b["fc1"](x)))
            if i == 3:
                x = x @ self.blocks[0]["fc2"].weight[:, :8].t()
        return nn.functional.mse_loss(x.cumsum(-1), y)  # the features whole


def _read_twice_job():
    s = Strategy(tp=2, pp=2, global_batch_size=8, micro_batch_size=2,
                 layer_pattern=r"blocks\.(\d+)",
                 tp_plan=((r"blocks\.\d+\.fc1", "colwise"), (r"blocks\.\d+\.fc2", "rowwise")))
    torch.manual_seed(0)
    module = ReadTwice()
    batches = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(3)]
    graph = capture(module, (batches[0][0][:2], batches[0][1][:2]))
    return mp.plan(graph, Mesh(1, 4), s, "adamw"), module, batches


def test_a_weight_two_stages_read_in_different_layouts_trains_as_eager():
    """Each stage's accumulator of `blocks.0.fc2.weight` rests in the layout
    its first use chose; a later use's contribution is boxed to it, never the
    accumulator (None before a step's first micro-batch) to the use."""
    job, module, batches = _read_twice_job()
    assert check_plans(job, {r: lower(job, r) for r in range(4)}).ok
    run = run_local(job, copy.deepcopy(module), batches)
    verdict, _ = against_eager(run.rank_losses, run.slices, module, batches,
                               job.strategy.num_microbatches, OptimizerConfig.default("adamw"))
    assert verdict["ok"], verdict["problems"]
    assert "blocks.0.fc2.weight" in verdict["params"]


def test_the_check_refuses_an_accumulator_written_in_another_layout(monkeypatch):
    """Planted: let boxing convert the accumulator to its use's layout (the
    bug: stage 0 wrote a tp shard of a state held whole, and crashed reading
    the absent accumulator); proof 9 names the state."""
    import meshplan.passes.propagate as propagate

    monkeypatch.setattr(propagate, "_keeps_accumulator", lambda acc: lambda sig: True)
    job, _, _ = _read_twice_job()
    res = check_plans(job, {r: lower(job, r) for r in range(4)})
    assert not res.ok
    assert any("state 'blocks.0.fc2.weight@grad' rests as [8, 16]" in e and "writes [8, 8]" in e
               for e in res.errors), res.errors
