"""lowering/action_times.py costs actions on a device model: collectives
over the inter-node link exactly when their group spans nodes of the Job's
mesh, transfers likewise, compute at the dtype's rate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.costmodel import CPU_DEFAULT
from meshplan.ir.graph import Role
from meshplan.lowering.action_times import action_costs
from tests.lowering.jobs import job_of, plans_of

NO_LATENCY = replace(CPU_DEFAULT, intra_latency=0.0, inter_latency=0.0)


def reps(name: str) -> dict:
    job, plans = job_of(name), plans_of(name)
    return {s: plans[job.strategy.ranks_of_stage(s)[0]] for s in range(job.strategy.pp)}


def grad_bytes(job) -> int:
    return sum(v.meta.nbytes for v in job.graph.values if v.role is Role.PARAM)


def test_a_dp_group_across_nodes_is_costed_on_the_inter_node_link():
    name = "resnet_dp4"  # 2 nodes x 2 devices, dp=4: the gradient all-reduce spans both
    job = job_of(name)
    base = action_costs(job, reps(name), NO_LATENCY)
    slow_inter = action_costs(job, reps(name), replace(NO_LATENCY, inter_bw=1e8))
    slow_intra = action_costs(job, reps(name), replace(NO_LATENCY, intra_bw=1e8))
    assert slow_intra == base
    # no latency: the ring is always the cheaper; each gradient moves 2(n-1)/n of its bytes
    extra = 2 * 3 / 4 * grad_bytes(job) * (1 / 1e8 - 1 / NO_LATENCY.inter_bw)
    assert slow_inter[("step", 0)] - base[("step", 0)] == pytest.approx(extra, rel=1e-6)


def test_a_group_inside_a_node_is_costed_on_the_intra_node_link():
    name = "gpt_pp1"  # 1 node x 4 devices
    job = job_of(name)
    base = action_costs(job, reps(name), NO_LATENCY)
    assert action_costs(job, reps(name), replace(NO_LATENCY, inter_bw=1e3)) == base
    slow = action_costs(job, reps(name), replace(NO_LATENCY, intra_bw=1e8))
    assert slow[("step", 0)] > base[("step", 0)]


def test_a_transfer_between_nodes_is_costed_on_the_inter_node_link():
    far, near = "gpt_1f1b", "gpt_gpipe"  # stages on two nodes; four stages on one node
    base = action_costs(job_of(far), reps(far), NO_LATENCY)
    slow = action_costs(job_of(far), reps(far), replace(NO_LATENCY, inter_bw=1e6))
    assert slow[("comm", 0, 1)] > 100 * base[("comm", 0, 1)] > 0
    base = action_costs(job_of(near), reps(near), NO_LATENCY)
    assert action_costs(job_of(near), reps(near), replace(NO_LATENCY, inter_bw=1e3)) == base


def test_compute_follows_the_device_rate():
    name = "gpt_gpipe"
    job = job_of(name)
    base = action_costs(job, reps(name), CPU_DEFAULT)
    fast = action_costs(job, reps(name), replace(CPU_DEFAULT, flops=tuple(
        (d, 1e20) for d, _ in CPU_DEFAULT.flops), mem_bw=1e20))
    for v in range(job.strategy.pp):
        assert fast[(v, "F")] < base[(v, "F")] / 100
