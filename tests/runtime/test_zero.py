"""Sharded data parallel (ZeRO 1/2/3) as layouts: equal to eager PyTorch in
losses, parameters and optimizer slots (assembled from the shards); the
planned bytes of each sharded category are 1/dp of plain data parallel's;
a ZeRO-3 checkpoint resumes at other layouts with the same losses."""

from __future__ import annotations

import shutil

import pytest

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.run import run
from meshplan.driver.verify import verify
from meshplan.ir import Role
from meshplan.ir.kinds import ALL_GATHER, REDUCE_SCATTER
from meshplan.ir.mesh import Mesh
from meshplan.ir.sbp import Shard
from meshplan.lowering.check import check_plans
from meshplan.lowering.lower import lower
from meshplan.models import model_config

TOL = 1e-5
CASES = {  # name: (model, ranks, strategy fields, model overrides)
    "gpt-dp4-zero1": ("gpt", 4, dict(dp=4, zero=1), {}),
    "gpt-dp4-zero2": ("gpt", 4, dict(dp=4, zero=2), {}),
    "gpt-dp4-zero3": ("gpt", 4, dict(dp=4, zero=3), {}),
    "bert-dp4-zero1": ("bert", 4, dict(dp=4, zero=1), {}),
    "bert-dp4-zero2": ("bert", 4, dict(dp=4, zero=2), {}),
    "bert-dp4-zero3": ("bert", 4, dict(dp=4, zero=3), {}),
    "gpt-dp2-tp2-zero3": ("gpt", 4, dict(dp=2, tp=2, zero=3), {}),
    "gpt-dp2-pp2-zero1": ("gpt", 4, dict(dp=2, pp=2, zero=1), {}),
    # hidden 36, vocab 99, 3 heads: no parameter dimension divides by dp = 4
    "gpt-uneven-dp4-zero3": ("gpt", 4, dict(dp=4, zero=3),
                             dict(hidden=36, heads=3, vocab=99)),
}
SLOW = {"bert-dp4-zero1", "bert-dp4-zero2", "gpt-dp4-zero2"}


def _strategy(model: str, overrides: dict, **fields):
    dp = fields.get("dp", 1)
    fields = {"global_batch_size": 8, "micro_batch_size": max(1, 4 // dp)} | fields
    return zoo_strategy(model, model_config(model, "tiny", **overrides), **fields)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in CASES])
def test_equal_to_eager_in_losses_parameters_and_slots(name):
    model, ranks, fields, overrides = CASES[name]
    r = verify(model, "tiny", steps=4, mesh=Mesh(1, ranks), optimizer="adamw",
               strategy=_strategy(model, overrides, **fields), **overrides)
    assert r["ok"], r["problems"]
    assert r["max_abs_diff"] <= TOL, (r["losses"], r["ref_losses"])
    assert r["params"] and r["optimizer_state"]


def _planned(zero: int, **overrides) -> tuple:
    # no gradient buckets: their flat copies would count as gradient bytes
    s = _strategy("gpt", overrides, dp=4, zero=zero, bucket_mb=0)
    job = plan_model("gpt", "tiny", Mesh(1, 4), s, optimizer="adamw", **overrides).job
    plans = {r: lower(job, r) for r in range(4)}
    assert check_plans(job, plans).ok
    return job, {r: dict(p.memory.peak) for r, p in plans.items()}


def test_each_zero_stage_shards_its_category_by_dp():
    _, plain = _planned(0)
    for zero, sharded in ((1, {"optimizer"}), (2, {"optimizer", "grad"}),
                          (3, {"optimizer", "grad", "param"})):
        job, peak = _planned(zero)
        for r in range(4):
            for cat in ("param", "grad", "optimizer"):
                want = plain[r][cat] / 4 if cat in sharded else plain[r][cat]
                # within padding: AdamW's step counters stay whole (4 bytes each)
                assert abs(peak[r][cat] - want) <= 4 * 53, (zero, r, cat, peak[r][cat], want)


def test_zero_communicates_by_reduce_scatter_and_all_gather():
    job, _ = _planned(3)
    kinds = [op.kind for op in job.graph.ops]
    params = job.graph.inputs_by_role(Role.PARAM)
    assert kinds.count(REDUCE_SCATTER) >= len(params) - 2  # a 1-element dim stays whole
    # gathered for the forward and again for the backward (freed in between)
    assert kinds.count(ALL_GATHER) > len(params)
    sharded = [v for v in params if any(isinstance(s, Shard) for s in job.sbp[v.id][:1])]
    assert len(sharded) >= len(params) - 2


def test_uneven_parameters_shard_in_near_equal_parts():
    job, peak = _planned(3, hidden=36, heads=3, vocab=99)
    wte = next(v for v in job.graph.inputs_by_role(Role.PARAM) if v.name == "wte.weight")
    assert wte.meta.shape == (99, 36) and job.sbp[wte.id][0] == Shard(0)
    plans = [lower(job, r) for r in range(4)]
    rows = [next(b.shape for b in p.buffers if b.value == wte.id)[0] for p in plans]
    assert rows == [25, 25, 25, 24]


def test_zero3_checkpoint_resumes_at_other_layouts(tmp_path):
    saved = _strategy("gpt", {}, dp=4, zero=3)
    full = run("gpt", "tiny", Mesh(1, 4), saved, steps=4, optimizer="adamw")
    run("gpt", "tiny", Mesh(1, 4), saved, steps=2, optimizer="adamw",
        save_dir=str(tmp_path / "at2"))
    for k, fields in enumerate((dict(dp=2, zero=3), dict(dp=2), dict(tp=2))):
        here = tmp_path / str(k)  # a resumed run saves again: each resumes from a copy
        shutil.copytree(tmp_path / "at2", here)
        other = run("gpt", "tiny", Mesh(1, 2), _strategy("gpt", {}, **fields), steps=4,
                    optimizer="adamw", save_dir=str(here), resume=True)
        diff = max(abs(a - b) for a, b in zip(other["losses"], full["losses"][2:]))
        assert diff <= TOL, (fields, other["losses"], full["losses"][2:])


def test_plan_prints_the_zero_level_and_each_stage_memory():
    import json

    from tests.cli.test_cli import run as cli

    p = cli("plan", "--devices-per-node", "4", "--dp", "4", "--zero", "3", "--optimizer",
            "adamw", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["zero"] == 3 and [m["stage"] for m in r["memory"]] == [0]
    plain = json.loads(cli("plan", "--devices-per-node", "4", "--dp", "4", "--optimizer",
                           "adamw", "--json").stdout)
    assert abs(r["memory"][0]["param"] - plain["memory"][0]["param"] / 4) <= 4 * 53
    name = cli("plan", "--devices-per-node", "4", "--dp", "4", "--zero", "3",
               "--print-config").stdout.strip()
    assert name.endswith("_pp1_zero3_mb2_gb8_1n4g"), name


def test_zero3_gathers_are_prefetched_a_layer_ahead_and_planned(monkeypatch):
    import meshplan.lowering.memory as memory
    from meshplan.lowering.prefetch import gather_groups, prefetched_bytes

    job, _ = _planned(3)
    plan = lower(job, 0)
    groups = gather_groups(plan.tasks, job.graph.ops.__getitem__, job.graph.values,
                           job.strategy.layer_pattern)
    forward = [k for k in groups if k[1].value == "forward"][0]
    layers = [{job.graph.ops[t.op].module_path.split(".")[1] for t in g
               if job.graph.ops[t.op].module_path.startswith("blocks.")} for g in groups[forward]]
    assert [x for x in layers if x] == [{"0"}, {"1"}, {"2"}, {"3"}]  # one group a block
    size = {b.id: b.nbytes for b in plan.buffers}
    ahead = prefetched_bytes(plan.tasks, job.graph.ops.__getitem__, job.graph.values,
                             job.strategy.layer_pattern, lambda t: size[t.outputs[0]])
    # a layer's flat tensors, and the next layer's, started when its first is taken
    layer = [[sum(size[t.outputs[0]] for t in g) for g in gs] for gs in groups.values()]
    assert ahead == max(max(ls[j] + (ls[j + 1] if j + 1 < len(ls) else 0)
                            for j in range(len(ls))) for ls in layer)
    monkeypatch.setattr(memory, "prefetched_bytes", lambda *a: 0)
    unplanned = dict(lower(job, 0).memory.peak)["activation"]
    assert ahead > 0 and dict(plan.memory.peak)["activation"] == unplanned + ahead


def test_zero3_gathers_a_layer_in_one_collective(monkeypatch):
    """Each layer's parameter gathers travel as one collective (one per
    layer and run of a task group), every gather of the plan in one."""
    import torch

    from meshplan.lowering.prefetch import gather_groups
    from meshplan.models import build_model, example_batch
    from meshplan.runtime.local import LocalComm, local_ranks, train_local

    job, _ = _planned(3)
    calls: list[tuple[int, int]] = []  # (rank, tensors gathered)
    many = LocalComm.all_gather_many_async
    monkeypatch.setattr(LocalComm, "all_gather_many_async", lambda self, xs, *a: (
        calls.append((self.rank, len(xs))), many(self, xs, *a))[1])
    cfg = model_config("gpt", "tiny")
    torch.manual_seed(0)
    hub, ranks = local_ranks(job, build_model(cfg))
    train_local(job, hub, ranks, [example_batch(cfg, 8, seed=0)])
    plan = lower(job, 0)
    groups = gather_groups(plan.tasks, job.graph.ops.__getitem__, job.graph.values,
                           job.strategy.layer_pattern)
    m = job.strategy.num_microbatches
    mine = [n for r, n in calls if r == 0]
    assert len(mine) == m * sum(len(gs) for gs in groups.values())
    assert sum(mine) == m * sum(len(g) for gs in groups.values() for g in gs)
    assert max(mine) > 1


def test_a_reduce_scatter_shard_does_not_keep_the_full_gradient_alive():
    """Found by the sharded-DP benchmark: a dim-0 shard was a view of the full
    all-reduced gradient, and the accumulator adopting it kept 4x its bytes."""
    import torch

    from meshplan.models import build_model, example_batch
    from meshplan.runtime.local import local_ranks, train_local

    s = _strategy("gpt", {}, dp=4, zero=2, global_batch_size=8, micro_batch_size=2)
    job = plan_model("gpt", "tiny", Mesh(1, 4), s, optimizer="adamw").job
    cfg = model_config("gpt", "tiny")
    torch.manual_seed(0)
    hub, ranks = local_ranks(job, build_model(cfg))
    train_local(job, hub, ranks, [example_batch(cfg, 8, seed=0)])
    ex, state = ranks[0]
    grads = [state[n] for n in ex.grad_names if state.get(n) is not None]
    assert grads
    held = sum(g.untyped_storage().nbytes() for g in grads)
    assert held == sum(g.numel() * g.element_size() for g in grads)


@pytest.mark.parametrize("zero", [1, 2])
def test_sgd_momentum_made_by_the_first_step_under_zero(zero):
    """SGD's momentum buffer does not exist before the first step (torch makes
    it then). A slot whose optimizer reads it whole gathers it from its shards
    at zero >= 1: an absent slot passes through its boxing ops on every rank
    alike (it crashed the first step before)."""
    s = _strategy("gpt", {}, dp=2, zero=zero)
    r = verify("gpt", "tiny", steps=3, mesh=Mesh(1, 2), optimizer="sgd", strategy=s)
    assert r["ok"], r["problems"]


def _params_after_two_steps(**fields) -> tuple[list, list]:
    """(each rank's parameter tensors before, after two steps) of GPT tiny."""
    import torch

    from meshplan.models import build_model, example_batch
    from meshplan.runtime.local import local_ranks, train_local

    s = _strategy("gpt", {}, global_batch_size=8, micro_batch_size=2, **fields)
    job = plan_model("gpt", "tiny", Mesh(1, 2), s, optimizer="adamw").job
    cfg = model_config("gpt", "tiny")
    torch.manual_seed(0)
    hub, ranks = local_ranks(job, build_model(cfg))
    params = {v.name for v in job.graph.values if v.role is Role.PARAM}
    before = [{n: t for n, t in state.items() if n in params} for _, state in ranks]
    train_local(job, hub, ranks, [example_batch(cfg, 8, seed=i) for i in range(2)])
    return before, [{n: state[n] for n in b} for b, (_, state) in zip(before, ranks)]


@pytest.mark.parametrize("zero, bucket_mb", [(1, 0.2), (1, 0), (2, 0.2)])
def test_zero_gathers_each_updated_parameter_into_its_own_tensor(zero, bucket_mb):
    """ZeRO 1 and 2's STEP gathers write each parameter into its own tensor,
    bucketed or not, so the step holds no second copy of the parameters (the
    plan's layout has the update alias its state; the allocator measured the
    old and new ones both alive, 7-11% past the plan at ZeRO 2)."""
    before, after = _params_after_two_steps(dp=2, zero=zero, bucket_mb=bucket_mb)
    for b, a in zip(before, after):
        assert b and all(a[n] is t for n, t in b.items())


def test_a_gather_into_a_fresh_tensor_is_caught(monkeypatch):
    """Planted: the gathers write fresh tensors (as before)."""
    from meshplan.runtime.rank_executor import RankExecutor

    monkeypatch.setattr(RankExecutor, "_into", lambda self, vid: None)
    with pytest.raises(AssertionError):
        test_zero_gathers_each_updated_parameter_into_its_own_tensor(1, 0.2)
