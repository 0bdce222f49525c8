"""Expert parallelism (issue 38): `--ep N` splits the experts over ranks of
a data-parallel group, and the tokens reach them by the all-to-alls the
boxing derives. Judged against eager (fp32 1e-5, losses and every
parameter, router included), and by the plan's own structure."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.cli.main import main
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.reference import eager_train
from meshplan.errors import ConfigError
from meshplan.ir import Role
from meshplan.ir.kinds import ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.ir.sbp import Replicate, Shard, local_shape
from meshplan.lowering.check import check_plans
from meshplan.lowering.lower import lower
from meshplan.lowering.rankplan import TaskKind
from meshplan.models import build_model, example_batch, model_config
from meshplan.passes.expert_parallel import expert_params, is_expert_param
from meshplan.passes.strategy import check_strategy
from meshplan.runtime.local import run_local
from tests.runtime._util import eager_verdict

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYOUTS = {"ep2": (2, dict(dp=2, ep=2)), "ep4": (4, dict(dp=4, ep=4)),
           "dp4ep2-zero1": (4, dict(dp=4, ep=2, zero=1)),
           "ep2tp2": (4, dict(dp=2, ep=2, tp=2)), "ep2pp2": (4, dict(dp=2, ep=2, pp=2))}


def _job(world: int, fields: dict, factor: float | None = None, optimizer: str = "sgd",
         batch: int = 8):
    cfg = model_config("moe", "tiny", capacity_factor=factor)
    s = zoo_strategy("moe", cfg, global_batch_size=batch, micro_batch_size=2, **fields)
    return cfg, s, plan_model("moe", "tiny", Mesh(1, world), s, optimizer, None,
                              capacity_factor=factor).job


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("factor", [None, 1.0], ids=["dropless", "capacity1"])
def test_expert_parallel_moe_trains_as_eager(layout, factor):
    world, fields = LAYOUTS[layout]
    cfg, s, job = _job(world, fields, factor)
    verdict = eager_verdict(job, cfg, 8, steps=3)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, verdict["problems"]
    assert any("router" in n for n in verdict["params"])
    assert any(".experts.w1" in n for n in verdict["params"])


@pytest.mark.parametrize("world, dp", [(2, 2), (4, 4)], ids=["dp2ep2", "dp4ep2"])
def test_experts_split_and_tokens_travel_by_all_to_all(world, dp):
    """Each rank holds E/ep whole experts, no expert weight is ever
    gathered, each block's forward moves its tokens by exactly two
    all-to-alls over ep (dispatch and combine), and its backward by four
    (their gradients, and the gates'), with dp/ep ranks beside ep too (a
    later axis chooses on one shard of the earlier's: `expand`'s rule reads
    its output's shape, not its literal sizes)."""
    cfg, s, job = _job(world, dict(dp=dp, ep=2))
    g, ep_axis = job.graph, s.ep_axis
    inputs = [g.values[i] for i in g.inputs]
    experts = {v.id: v for v in g.inputs_by_role(Role.PARAM) if is_expert_param(v.name)}
    assert len(experts) == 2 * cfg.layers
    for vid, v in experts.items():
        assert job.sbp[vid][ep_axis] == Shard(0)
        assert local_shape(v.meta.shape, job.sbp[vid], s.grid, (0, 1, 0))[0] == \
            cfg.experts // s.ep
    for op in g.ops:
        if op.kind == ALL_GATHER:
            assert op.args[0].id not in experts
    forward = [op for op in g.ops if op.kind == ALL_TO_ALL and op.phase.name == "FORWARD"]
    assert len(forward) == 2 * cfg.layers
    # the combine sends the experts' outputs back; it is not a partial sum over
    # the experts reduced after (greedy chose that before a forward Partial
    # was charged its reduction: propagate.reduce_cost)
    assert not [op for op in g.ops if op.kind == REDUCE_SCATTER and op.phase.name == "FORWARD"]
    assert all(dict(op.kwargs)["axis"] == ep_axis for op in forward)
    backward = [op for op in g.ops if op.kind == ALL_TO_ALL and op.phase.name == "BACKWARD"]
    assert len(backward) == 4 * cfg.layers
    dense = next(v for v in inputs if v.name == "blocks.0.attn.qkv.weight")
    assert job.sbp[dense.id] == (Replicate(),) * 3


def test_many_dp_ranks_beside_ep_still_send_tokens_not_experts():
    """At dp64·ep2 (32 ranks on the axis before ep), the ep axis still
    chooses all-to-alls: a later axis prices the part of a tensor the
    earlier axes leave it (`propagate._after_split`), not the whole; priced
    whole, the tokens of all 64 ranks outweighed the experts, and every
    expert weight was gathered instead."""
    cfg = model_config("moe", "tiny", experts=8)
    s = zoo_strategy("moe", cfg, dp=64, ep=2, global_batch_size=64, micro_batch_size=1)
    job = plan_model("moe", "tiny", Mesh(1, 64), s, "sgd", None, experts=8).job
    assert sum(op.kind == ALL_TO_ALL for op in job.graph.ops) == 6 * cfg.layers
    assert not [n for n in job.notes if n.startswith("ep: the expert weights are gathered")]


def test_check_proves_the_all_to_alls_and_catches_one_out_of_order():
    """`check` proves an ep plan; one rank issuing its dispatch and combine
    in the other order is caught, naming the group."""
    _, _, job = _job(4, dict(dp=4, ep=2))
    plans = {r: lower(job, r) for r in range(4)}
    assert check_plans(job, plans).ok
    p = plans[1]
    a2a = [i for i, t in enumerate(p.tasks) if t.kind is TaskKind.COLLECTIVE
           and job.graph.ops[t.op].kind == ALL_TO_ALL]
    i, j = a2a[:2]
    tasks = list(p.tasks)
    tasks[i], tasks[j] = tasks[j], tasks[i]
    res = check_plans(job, plans | {1: replace(p, tasks=tuple(tasks))})
    assert not res.ok
    assert any(f"collective order differs in group {list(p.tasks[i].group)}" in e
               for e in res.errors), res.errors


def test_zero_shards_dense_states_over_dp_and_ep_and_experts_over_dp():
    """ZeRO over dp·ep: a dense weight's slot is split over both data axes
    (nested), an expert weight's over dp only (it is split over ep already)."""
    _, s, job = _job(4, dict(dp=4, ep=2, zero=1), optimizer="adamw")
    names = {job.graph.values[i].name: i for i in job.graph.inputs}
    dense = job.sbp[names["blocks.0.attn.qkv.weight@exp_avg"]]
    expert = job.sbp[names["blocks.0.moe.experts.w1@exp_avg"]]
    assert dense[:2] == (Shard(0), Shard(0))
    assert expert[1] == Shard(0) and isinstance(expert[0], Shard) and expert[0].dim != 0


def test_zero_over_more_ranks_than_experts_splits_a_wider_dim():
    """4 experts over dp8 (ep 1): ZeRO shards an expert weight's state on a
    dim with a row per rank, so every rank holds an eighth; split on the
    experts' dim, ranks 0-3 held a whole expert each and the rest none (the
    search's estimate of a Mixtral-sized ZeRO-3 was 35 GiB, its plan 160)."""
    cfg = model_config("moe", "tiny")
    s = zoo_strategy("moe", cfg, dp=8, zero=1, global_batch_size=8, micro_batch_size=1)
    job = plan_model("moe", "tiny", Mesh(1, 8), s, "adamw", None).job
    names = {job.graph.values[i].name: i for i in job.graph.inputs}
    assert job.sbp[names["blocks.0.moe.experts.w1@exp_avg"]][0] == Shard(1)
    held = {dict(lower(job, r).memory.peak)["optimizer"] for r in range(8)}
    assert max(held) < 1.1 * min(held), held


def test_a_model_without_experts_or_an_ep_that_does_not_divide_is_one_line():
    gpt = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", gpt, dp=2, ep=2, global_batch_size=8)
    with pytest.raises(ConfigError, match="no expert weights"):
        plan_model("gpt", "tiny", Mesh(1, 2), s)
    with pytest.raises(ConfigError, match="does not divide the model's 4 experts"):
        _job(3, dict(dp=3, ep=3), batch=6)
    with pytest.raises(ConfigError, match="ep=2 does not divide dp=3"):
        check_strategy(Mesh(1, 3), Strategy(dp=3, ep=2, global_batch_size=3))


def test_expert_params_are_a_fused_experts_modules_own():
    assert is_expert_param("model.layers.0.mlp.experts.gate_up_proj")
    assert is_expert_param("blocks.1.moe.experts.w2")
    assert not is_expert_param("model.layers.0.mlp.experts.0.w1.weight")  # a per-expert list
    assert not is_expert_param("model.layers.0.mlp.shared_expert.gate_proj.weight")
    _, _, job = _job(2, dict(dp=2, ep=2))
    assert len(expert_params(job.graph, 2)) == 2 * model_config("moe", "tiny").layers


def test_verify_expert_parallel_on_processes(capsys):
    """`meshplan verify --model moe --ep 2` on 4 gloo processes: the
    all-to-alls run as torch.distributed's all_to_all_single."""
    code = main(["verify", "--model", "moe", "--devices-per-node", "4", "--ep", "2",
                 "--steps", "2", "--global-batch-size", "8", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert '"ok": true' in out


def _eager_load(module, batches, microbatches: int, routers: dict) -> dict[str, list]:
    """Tokens per expert per step, counted by forward hooks on the eager
    model's routers while torch trains it (`routers`: block -> a function of
    the router module's output giving the chosen experts)."""
    counts: dict[str, list] = {}
    step = {"k": 0}
    for block, choices in routers.items():
        mod = module.get_submodule(block)
        experts = mod.experts.w1.shape[0] if hasattr(mod.experts, "w1") else \
            mod.experts.gate_up_proj.shape[0]

        def hook(_m, _inp, out, block=block, choices=choices, experts=experts):
            got = torch.bincount(choices(out).reshape(-1), minlength=experts)
            rows = counts.setdefault(block, [])
            if len(rows) <= step["k"]:
                rows.append(torch.zeros(experts, dtype=torch.long))
            rows[step["k"]] += got
        router = mod.router if hasattr(mod, "router") else mod.gate
        router.register_forward_hook(hook)

    def next_step(k):
        step["k"] = k
    eager_train(module, batches, microbatches, OptimizerConfig.default("sgd", None),
                after_step=next_step)
    return {b: [r.tolist() for r in rows] for b, rows in counts.items()}


@pytest.mark.parametrize("model, world, fields", [
    ("moe", 2, dict(dp=2, ep=2)), ("moe", 4, dict(dp=2, ep=2, pp=2)),
    ("hf:mixtral", 2, dict(dp=2, ep=2))])
def test_tokens_per_expert_equal_eager_hooks(model, world, fields):
    """The run's report of each block's tokens per expert, per step, equals
    the eager model's router choices counted by hooks while torch trains it
    (the weights, and so the choices, change step by step)."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    cfg = model_config(model, "tiny")
    s = zoo_strategy(model, cfg, global_batch_size=8, micro_batch_size=2, **fields)
    job = plan_model(model, "tiny", Mesh(1, world), s, "sgd", None).job
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, 8, seed=i) for i in range(3)]
    run = run_local(job, copy.deepcopy(module), batches)
    if model == "moe":
        k = cfg.top_k
        routers = {f"blocks.{i}.moe": lambda out: torch.softmax(out, -1).topk(k, -1)[1]
                   for i in range(cfg.layers)}
    else:
        routers = {f"model.model.layers.{i}.mlp": lambda out: out[2]
                   for i in range(cfg.layers)}
    want = _eager_load(copy.deepcopy(module), batches, s.num_microbatches, routers)
    got = {name.removeprefix("tokens_per_expert/"): v for name, v in run.reports.items()}
    assert got == want
    tokens = 8 * cfg.seq_len * (cfg.top_k if model == "moe" else 2)
    assert all(sum(step) == tokens for rows in got.values() for step in rows)


def test_run_reports_tokens_per_expert_on_processes():
    """`meshplan run --ep 2` on 2 gloo processes: the JSON holds each
    block's tokens per expert per step; each step counts every token's k
    choices (global batch 8 x seq 16 x top-2)."""
    p = subprocess.run([sys.executable, "-m", "meshplan", "run", "--model", "moe",
                        "--devices-per-node", "2", "--ep", "2", "--steps", "2", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    reports = json.loads(p.stdout.strip().splitlines()[-1])["reports"]
    assert sorted(reports) == [f"tokens_per_expert/blocks.{i}.moe" for i in range(4)]
    assert all(len(steps) == 2 and all(sum(s) == 8 * 16 * 2 and len(s) == 4 for s in steps)
               for steps in reports.values())


@pytest.mark.parametrize("factor, bound", [(None, "dropless, 16 tokens per expert"),
                                           ("1.0", "capacity factor 1, 8 tokens per expert")])
def test_plan_says_the_experts_and_the_dispatch_bound(capsys, factor, bound):
    """`plan` prints the experts per rank, the all-to-all bytes a step and the
    dispatched buffer per rank with the bound it is planned at (2 samples x
    4 experts x capacity x hidden 64 x 4 bytes)."""
    more = ["--capacity-factor", factor] if factor else []
    assert main(["plan", "--model", "moe", "--devices-per-node", "4", "--ep", "2", *more]) == 0
    out = capsys.readouterr().out
    assert "experts: 4 per block, 2 per rank (ep 2); all-to-all" in out
    capacity = 16 if factor is None else 8
    assert f"dispatched tokens: {2 * 4 * capacity * 64 * 4 / 1024:.1f} KiB per rank" in out
    assert bound in out
