"""Mutation tests: real bugs planted in a compiled plan or in its execution,
and `verify`'s verdict (losses and every parameter and optimizer slot
against eager, `driver.verify.judge`) must fail for each one, in fp32 and
bf16, while the unmutated run passes. Plan-level mutations must also be
caught statically by `check_plans`.

The job: GPT tiny, dp=2 tp=2 pp=2 (8 ranks on threads, `runtime.local`),
2 micro-batches per step, 3 SGD steps, on the zoo's learnable data.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import against_eager
from meshplan.ir import GRAD_NORM, Phase, Role
from meshplan.ir.kinds import ALL_REDUCE, GRAD_SQ
from meshplan.ir.mesh import Mesh
from meshplan.lowering.check import check_plans
from meshplan.lowering.lower import lower
from meshplan.lowering.rankplan import TaskKind
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime.comm import tag_of
from meshplan.runtime.local import local_ranks, train_local
from meshplan.schedules.action import ActionType

# No gradient buckets: these mutations tamper with the accumulators between
# the last backward and the STEP, which is where the STEP reads them without
# buckets; with buckets the reduction reads the last micro-batch's gradients
# inside the backward (tests/runtime/test_buckets.py plants bugs there).
STEPS, FIELDS = 3, dict(dp=2, tp=2, pp=2, global_batch_size=8, micro_batch_size=2,
                        bucket_mb=0)
TARGET = "blocks.3.mlp.fc1.weight"  # a tp-split weight on the last stage
VICTIM = 4  # a rank of the last stage (dp 0, tp 0)


@functools.cache
def job_of(precision: str, model: str = "gpt", fields: tuple = tuple(FIELDS.items()),
           optimizer: str | OptimizerConfig = "sgd", overrides: tuple = ()):
    cfg = model_config(model, "tiny", **dict(overrides))
    s = zoo_strategy(model, cfg, precision=precision, **dict(fields))
    return plan_model(model, "tiny", Mesh(1, s.dp * s.tp * s.pp), s, optimizer,
                      **dict(overrides)).job


def train(precision: str, plans_mutation=None, run_mutation=None, model: str = "gpt",
          fields: dict = FIELDS, optimizer: str | OptimizerConfig = "sgd",
          steps: int = STEPS, overrides: tuple = (), job_mutation=None) -> dict:
    """verify's verdict on one (possibly mutated) local run."""
    job = job_of(precision, model, tuple(fields.items()), optimizer, overrides)
    if job_mutation is not None:
        job = job_mutation(job)
    cfg = model_config(model, "tiny", **dict(overrides))
    torch.manual_seed(0)
    module = build_model(cfg)
    gbs = job.strategy.global_batch_size
    batches = [example_batch(cfg, gbs, seed=s) for s in range(steps)]
    plans = {r: lower(job, r) for r in range(job.mesh.world)}
    if plans_mutation is not None:
        plans = plans_mutation(job, plans)
    hub, ranks = local_ranks(job, module, plans, timeout_s=30)
    if run_mutation is not None:
        run_mutation(job, hub, ranks)
    run = train_local(job, hub, ranks, batches, timeout_s=30)
    verdict, _ = against_eager(run.rank_losses, run.slices, module, batches,
                               job.strategy.num_microbatches,
                               OptimizerConfig.of(optimizer), precision,
                               rank_grad_norms=run.rank_grad_norms)
    return verdict


# ---------------------------------------------------------------- plan level
def drop_dp_all_reduce(job, plans):
    """Every dp member runs the gradient all-reduce of TARGET as a group of one."""
    g = job.graph
    param = next(v.id for v in g.values if v.name == TARGET and v.role is Role.PARAM)
    step = next(op for op in g.ops if op.phase is Phase.OPTIMIZER and param in op.refs()
                and op.kind == "meshplan.sgd")
    reduce = next(op.id for op in g.ops if op.kind == "meshplan.all_reduce"
                  and set(op.outputs) & set(step.refs()))
    return {r: replace(p, tasks=tuple(replace(t, group=(r,)) if t.op == reduce else t
                                      for t in p.tasks)) for r, p in plans.items()}


def skip_optimizer_update(job, plans):
    """VICTIM's shard of TARGET never takes its optimizer step."""
    param = next(v.id for v in job.graph.values if v.name == TARGET and v.role is Role.PARAM)
    p = plans[VICTIM]
    tasks = tuple(t for t in p.tasks if not (t.kind is TaskKind.OPTIMIZER
                                            and param in job.graph.ops[t.op].refs()))
    assert len(tasks) == len(p.tasks) - 1
    return plans | {VICTIM: replace(p, tasks=tasks)}


# ---------------------------------------------------------------- execution level
def tp_all_reduce_noop(job, hub, ranks):
    """VICTIM joins its tp all-reduces but keeps its own partial sum."""
    ex, _ = ranks[VICTIM]
    real = ex.comm.all_reduce
    tp_group = next(g for g in ex.comm.groups if len(g) == 2 and g[1] - g[0] == 1)

    def noop(x, group, op):
        out = real(x, group, op)
        return x.clone() if group == tp_group else out

    ex.comm.all_reduce = noop  # the bound kernels look the method up at each call


def _around_actions(ranks, rank: int, before, after) -> None:
    ex, _ = ranks[rank]
    real = ex._action

    def action(a, envs, state, losses):
        snap = before(a, state)
        real(a, envs, state, losses)
        after(a, state, snap)

    ex._action = action


def count_microbatch_twice(job, hub, ranks):
    """On VICTIM, micro-batch 1's gradient contribution is added twice."""
    names = [n for n in ranks[VICTIM][0].grad_names]

    def before(a, state):
        if a.type is ActionType.B and a.microbatch == 1:
            return {n: None if state.get(n) is None else state[n].clone() for n in names}
        return None

    def after(a, state, snap):
        for n, old in (snap or {}).items():
            if state.get(n) is not None:
                state[n] = state[n] + (state[n] - (0 if old is None else old))

    _around_actions(ranks, VICTIM, before, after)


def scale_gradient(job, hub, ranks):
    """On VICTIM, TARGET's accumulated gradient is doubled before the step."""
    def before(a, state):
        if a.type is ActionType.STEP:
            state[f"{TARGET}@grad"] = state[f"{TARGET}@grad"] * 2

    _around_actions(ranks, VICTIM, before, lambda *_: None)


def swap_microbatch_payloads(job, hub, ranks):
    """The first stage-crossing activation arrives at VICTIM with micro-batch
    0's and 1's payloads exchanged."""
    transfer = next(op for op in job.graph.ops if op.kind == "meshplan.transfer"
                    and op.phase is Phase.FORWARD)
    tags = {tag_of(transfer.id, 0): tag_of(transfer.id, 1),
            tag_of(transfer.id, 1): tag_of(transfer.id, 0)}
    real = hub.take

    def take(key):
        src, dst, tag = key
        if dst != VICTIM or tag not in tags:
            return real(key)
        with hub.cv:  # wait for both payloads, then hand over the other one
            hub._wait(lambda: hub.mail.get((src, dst, tags[tag])), "the swapped payload")
        return real((src, dst, tags[tag]))

    hub.take = take


def _restore_after_step(names_of):
    def mutate(job, hub, ranks):
        for r, (_, held) in enumerate(ranks):
            names = [n for n in names_of(job) if n in held]

            def before(a, state, names=names):
                return {n: state[n].clone() for n in names} \
                    if a.type is ActionType.STEP else None

            def after(a, state, snap):
                state.update(snap or {})

            _around_actions(ranks, r, before, after)
    return mutate


# the run that trains nothing (lr=0), and one parameter frozen on every rank
train_nothing = _restore_after_step(
    lambda job: [v.name for v in job.graph.values if v.role is Role.PARAM])
freeze_one = _restore_after_step(lambda job: [TARGET])

PLAN_MUTATIONS = {"dropped dp gradient all-reduce": drop_dp_all_reduce,
                  "skipped optimizer update of one shard": skip_optimizer_update}
RUN_MUTATIONS = {"tp all-reduce a no-op on one rank": tp_all_reduce_noop,
                 "one micro-batch's gradient counted twice": count_microbatch_twice,
                 "a gradient scaled by 2 on one rank": scale_gradient,
                 "send/recv payloads swapped between micro-batches": swap_microbatch_payloads,
                 "nothing trained (lr=0)": train_nothing,
                 "one parameter frozen": freeze_one}
PRECISIONS = ["fp32", pytest.param("bf16", marks=pytest.mark.slow)]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_unmutated_run_passes(precision):
    verdict = train(precision)
    assert verdict["ok"], verdict["problems"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", PLAN_MUTATIONS)
def test_a_plan_mutation_fails_verify_and_check(name, precision):
    verdict = train(precision, plans_mutation=PLAN_MUTATIONS[name])
    assert not verdict["ok"], name
    job = job_of(precision)
    mutated = PLAN_MUTATIONS[name](job, {r: lower(job, r) for r in range(job.mesh.world)})
    res = check_plans(job, mutated)
    assert not res.ok, name
    assert "task(s) of op" in res.errors[0] or "runs over" in res.errors[0], res.errors


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", RUN_MUTATIONS)
def test_an_execution_mutation_fails_verify(name, precision):
    verdict = train(precision, run_mutation=RUN_MUTATIONS[name])
    assert not verdict["ok"], name


# ---------------------------------------------------------------- clipping's norm
CLIPPED = OptimizerConfig.of("sgd", max_grad_norm=1.0)  # GPT tiny's norm is ~5: every step clips
TIED = (("tie_embeddings", True),)


def count_tied_copy_twice(job):
    """Every copy of the tied embedding counts its (reduced, equal) gradient."""
    ops = tuple(replace(op, kwargs=tuple(kv for kv in op.kwargs if kv[0] != "counted"))
                if op.kind == GRAD_SQ else op for op in job.graph.ops)
    return replace(job, graph=replace(job.graph, ops=ops))


def skip_a_stage_in_the_norm(job, plans):
    """The norm's all-reduce across the stages runs as a group of one: each
    stage clips by its own gradients' norm (torchtitan's issue 596)."""
    across = {op.id for op in job.graph.ops if op.kind == ALL_REDUCE
              and dict(op.kwargs).get("param") == GRAD_NORM}
    return {r: replace(p, tasks=tuple(replace(t, group=(r,)) if t.op in across else t
                                      for t in p.tasks)) for r, p in plans.items()}


def test_the_clipped_tied_run_passes():
    verdict = train("fp32", optimizer=CLIPPED, overrides=TIED)
    assert verdict["ok"], verdict["problems"]


def test_a_norm_counting_a_tied_copy_twice_fails_verify_and_check():
    verdict = train("fp32", optimizer=CLIPPED, overrides=TIED,
                    job_mutation=count_tied_copy_twice)
    assert not verdict["ok"] and "gradient norm" in " ".join(verdict["problems"])
    job = count_tied_copy_twice(job_of("fp32", optimizer=CLIPPED, overrides=TIED))
    res = check_plans(job, {r: lower(job, r) for r in range(job.mesh.world)})
    assert not res.ok and "counts 'wte.weight' more than once" in res.errors[0], res.errors


def test_a_norm_skipping_a_stage_fails_verify_and_check():
    verdict = train("fp32", optimizer=CLIPPED, plans_mutation=skip_a_stage_in_the_norm)
    assert not verdict["ok"] and "gradient norm" in " ".join(verdict["problems"])
    job = job_of("fp32", optimizer=CLIPPED)
    res = check_plans(job, skip_a_stage_in_the_norm(job, {r: lower(job, r)
                                                          for r in range(job.mesh.world)}))
    assert not res.ok
    assert any("leaves out 'blocks." in e for e in res.errors), res.errors


def test_receives_of_two_microbatches_swapped_in_the_plan_fail_check():
    """The plan-level form of the swapped payloads: every rank of the last
    stage receives micro-batch 1's activation where micro-batch 0's belongs.
    Statically caught by the schedule validator: micro-batch 0's forward
    would run before its input arrives (running it could only fail)."""
    job = job_of("fp32")
    plans = {r: lower(job, r) for r in range(job.mesh.world)}
    for r, p in plans.items():
        if p.stage != plans[VICTIM].stage:
            continue
        actions = list(p.actions)
        a, b = [i for i, x in enumerate(actions) if x.type is ActionType.RECV_F][:2]
        actions[a], actions[b] = (replace(actions[a], microbatch=actions[b].microbatch),
                                  replace(actions[b], microbatch=actions[a].microbatch))
        plans[r] = replace(p, actions=tuple(actions))
    res = check_plans(job, plans)
    assert not res.ok
    assert "ERROR HERE" in res.errors[0] and "1F0" in res.errors[0], res.errors[0]
