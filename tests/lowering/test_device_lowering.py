"""Lowering per device type: CUDA plans of the zoo run CUDA kernels, never a
CPU-only one, and `check` accepts them. Runs on CPU: lowering needs no GPU."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.errors import PlanError
from meshplan.ir.kinds import DROPOUT
from meshplan.ir.mesh import Mesh
from meshplan.lowering.check import check_plans
from meshplan.lowering.files import through_files
from meshplan.lowering.ids import DEVICE_TYPES, TaskId
from meshplan.lowering.lower import lower
from meshplan.models import model_config
from meshplan.ops import device_kernels as dk

# model -> (devices, strategy fields): one parallel layout each, so boxing,
# transfers and collectives are in the plans too
LAYOUTS = {
    "gpt": (4, dict(tp=2, pp=2, global_batch_size=4, micro_batch_size=2)),
    "bert": (2, dict(tp=2, global_batch_size=4, micro_batch_size=4)),
    "resnet": (2, dict(dp=2, global_batch_size=4, micro_batch_size=2)),
}


@cache
def job_of(model: str, precision: str):
    devices, fields = LAYOUTS[model]
    cfg = model_config(model, "tiny")
    strategy = zoo_strategy(model, cfg, precision=precision, **fields)
    return plan_model(model, "tiny", Mesh(1, devices), strategy).job


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model", ["gpt", "bert", "resnet"])
def test_no_cpu_kernel_in_cuda_plans(model, precision):
    job = job_of(model, precision)
    plans = {r: lower(job, r, "cuda") for r in range(job.mesh.world)}
    kernels = {p.kernel_of(t, job.graph) for p in plans.values() for t in p.tasks}
    assert not [k for k in kernels if "_for_cpu" in k]
    assert all(TaskId.unpack(t.id).device_type == DEVICE_TYPES["cuda"]
               for p in plans.values() for t in p.tasks)
    res = check_plans(job, plans)
    assert res.ok, res.errors
    if model != "resnet":  # the transformers' attention runs eager's CUDA kernel
        want = {"fp32": {dk.EFFICIENT, dk.EFFICIENT_BACKWARD},
                "bf16": {dk.FLASH, dk.FLASH_BACKWARD}}[precision]
        assert want <= kernels
        assert dk.SDPA_CPU in {op.kind for op in job.graph.ops}  # the Job is unchanged


def test_cpu_plans_name_no_device_kernel():
    job = job_of("gpt", "fp32")
    plan = lower(job, 0)
    assert plan.device == "cpu" and all(t.kernel == "" for t in plan.tasks)
    assert dk.SDPA_CPU in {plan.kernel_of(t, job.graph) for t in plan.tasks}


def test_cuda_plan_round_trips_through_its_file():
    job = job_of("gpt", "bf16")
    plan = lower(job, 0, "cuda")
    back = through_files(plan, job)
    assert back == plan and back.device == "cuda"
    assert any(t.kernel == dk.FLASH for t in back.tasks)


def test_check_refuses_a_cpu_kernel_in_a_cuda_plan():
    job = job_of("gpt", "fp32")
    plans = {r: lower(job, r, "cuda") for r in range(job.mesh.world)}
    p = plans[0]
    bad = tuple(replace(t, kernel=dk.SDPA_CPU) if t.kernel == dk.EFFICIENT else t
                for t in p.tasks)
    plans[0] = replace(p, tasks=bad)
    res = check_plans(job, plans)
    assert not res.ok and any("CPU-only kernel" in e for e in res.errors)


def test_check_refuses_mixed_device_plans():
    job = job_of("gpt", "fp32")
    plans = {r: lower(job, r, "cuda" if r else "cpu") for r in range(job.mesh.world)}
    res = check_plans(job, plans)
    assert not res.ok and any("different device types" in e for e in res.errors)


def test_unknown_device_type_is_one_plan_error():
    with pytest.raises(PlanError, match="no lowering for device type 'tpu'"):
        lower(job_of("gpt", "fp32"), 0, "tpu")


def test_attention_choice_follows_eager_dispatch():
    """flash for bf16 with an aligned head, efficient for fp32, math when the
    head dim fits neither (the Note in ops/device_kernels.py)."""
    from meshplan.ir import Ref
    from meshplan.ir.graph import DType, Op, TensorMeta, Value

    def choose(dtype: str, head_dim: int) -> str:
        meta = TensorMeta((2, 4, 16, head_dim), DType(dtype))
        values = [Value(0, meta)]
        op = Op(0, dk.SDPA_CPU, (Ref(0), Ref(0), Ref(0), 0.0, True), (1, 2))
        return dk.cuda_sdpa(op, values)

    assert choose("bfloat16", 64) == dk.FLASH
    assert choose("float32", 64) == dk.EFFICIENT
    assert choose("float32", 12) == dk.EFFICIENT
    assert choose("bfloat16", 320) == dk.EFFICIENT  # past flash's largest head
    assert choose("bfloat16", 12) == dk.MATH
    assert choose("float32", 6) == dk.MATH


def test_attention_dropout_lowers_for_cuda():
    """Attention with dropout is aten ops and a `meshplan.dropout` (its mask
    layout-invariant), so no fused kernel draws a mask of its own and CUDA
    plans it like any op (the refusal it had is gone)."""
    cfg = model_config("gpt", "tiny", dropout=0.1)
    strategy = zoo_strategy("gpt", cfg, tp=2, global_batch_size=4, micro_batch_size=2)
    job = plan_model("gpt", "tiny", Mesh(1, 2), strategy, dropout=0.1).job
    kinds = {op.kind for op in job.graph.ops}
    assert DROPOUT in kinds and dk.SDPA_CPU not in kinds
    assert all(lower(job, r, "cuda").tasks for r in range(2))
