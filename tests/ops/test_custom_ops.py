"""Custom ops (`torch.library`) train through the generic rule (issue 38, part 1).

An op with a fake kernel and an autograd formula is shaped by the first and
differentiated by the second (through `torch.autograd.grad`, since
`torch.func.vjp` cannot run `register_autograd`'s function); the graph
names the module that registers it, and a rank's own process imports it on
reading the Job. An op without a formula is refused in one line.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import meshplan.api as mp
from meshplan.autodiff import OptimizerConfig
from meshplan.driver.compare import Bounds
from meshplan.driver.verify import against_eager
from meshplan.errors import CaptureError, PlanError
from meshplan.ir import DType, GraphBuilder, Op, Ref, Role, TensorMeta
from meshplan.ir.job import Job, StageView
from meshplan.ir.serialize import facts_from_pairs, facts_to_pairs
from meshplan.ops.device_kernels import HISTC_OF_FLOATS, adapter
from meshplan.ops.table import physical_kernel
from meshplan.runtime.local import local_ranks, train_local
from tests.ops.custom_ops_toy import Net, batches

TIGHT = Bounds(loss_atol=1e-6, atol=1e-6, rtol=1e-6)
MODULE = "tests.ops.custom_ops_toy"


def _job(op: str = "scaled_tanh", dp: int = 1):
    torch.manual_seed(0)
    module = Net(op)
    data = batches(3, 4 * dp)
    s = mp.Strategy(dp=dp, global_batch_size=4 * dp, micro_batch_size=2)
    graph = mp.capture(module, tuple(t[:2 * dp] for t in data[0]))
    return mp.plan(graph, mp.Mesh(1, dp), s), module, data


def test_the_graph_names_the_module_that_registers_its_custom_op():
    job, _, _ = _job()
    assert "meshplan_test.scaled_tanh.default" in {op.kind for op in job.graph.ops}
    assert job.graph.facts.op_modules == (MODULE,)
    assert Job.from_bytes(job.to_bytes()).graph.facts.op_modules == (MODULE,)
    assert StageView.from_bytes(job.to_bytes(), 0).facts.op_modules == (MODULE,)


def test_a_module_a_rank_cannot_import_is_one_line():
    job, _, _ = _job()
    facts = replace(job.graph.facts, op_modules=("tests.ops.no_such_module",))
    with pytest.raises(PlanError, match="registered by module 'tests.ops.no_such_module', "
                                        "which this process cannot import"):
        facts_from_pairs(facts_to_pairs(facts))


def test_a_custom_op_trains_equal_to_eager_at_one_rank():
    job, module, data = _job()
    hub, ranks = local_ranks(job, module, timeout_s=30)
    run = train_local(job, hub, ranks, data, timeout_s=30)
    verdict, _ = against_eager(run.rank_losses, run.slices, module, data, 2,
                               OptimizerConfig.default("sgd"), bounds=TIGHT)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-6, verdict["problems"]
    assert verdict["params"]["scale"]["ok"]  # the op's own gradient trained its input


def test_a_custom_op_trains_equal_to_eager_in_each_ranks_process():
    """dp2 on 2 gloo processes: each reads the Job, and so imports the op's module."""
    job, module, data = _job(dp=2)
    result = mp.verify(job, module, data, bounds=TIGHT, timeout_s=60)
    assert result.ok, result.problems
    assert "scale" in result.params


def test_a_custom_op_without_an_autograd_formula_is_refused_in_one_line():
    with pytest.raises(CaptureError, match=r"custom op 'meshplan_test.no_formula.default' "
                                           r"has no autograd formula.*register_autograd"):
        _job("no_formula")


def test_the_cpu_counts_integers_as_floats():
    """torch's CPU histc refuses integers, which a graph captured on meta
    (transformers' MoE routing) counts: on the CPU the op runs as floats."""
    b = GraphBuilder()
    ints = Ref(b.add_input(TensorMeta((6,), DType("int64")), Role.DATA, "ids"))
    floats = Ref(b.add_input(TensorMeta((6,), DType("float32")), Role.DATA, "x"))
    values = dict(enumerate(b.values))
    for x, cpu in ((ints, HISTC_OF_FLOATS), (floats, "")):
        op = Op(0, "aten.histc.default", (x, 4, 0, 3), (), ())
        assert physical_kernel(op, values, "cpu") == cpu
        assert physical_kernel(op, values, "cuda") == ""
    ids = torch.tensor([0, 3, 3, 1, 0, 3])
    counts = adapter(HISTC_OF_FLOATS)(ids, 4, 0, 3)
    assert counts.dtype == torch.int64 and counts.tolist() == [2, 1, 0, 3]
