"""Activation checkpointing: clones sit in the backward of their own chunk,
the forward keeps only region inputs, losses do not change, memory drops."""

from __future__ import annotations

import pytest

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import verify
from meshplan.errors import ConfigError
from meshplan.ir import Phase
from meshplan.ir.mesh import Mesh
from meshplan.lowering.lower import lower
from meshplan.models import model_config


def _job(recompute: str, size: str = "tiny", mesh=(1, 4), **fields):
    cfg = model_config("gpt", size)
    fields = dict(tp=2, pp=2, global_batch_size=8, micro_batch_size=2) | fields
    s = zoo_strategy("gpt", cfg, recompute=recompute, **fields)
    return plan_model("gpt", size, Mesh(*mesh), s).job


def _saved(job) -> set[int]:
    """Forward values read by backward ops of a layer."""
    g = job.graph
    made = {o: op for op in g.ops for o in op.outputs}
    out = set()
    for op in g.ops:
        if op.phase is Phase.BACKWARD and op.module_path.startswith("blocks."):
            out.update(r for r in op.refs()
                       if r in made and made[r].phase is Phase.FORWARD)
    return out


def test_clones_run_in_the_backward_of_their_forward_ops_chunk():
    plain, full = _job("none"), _job("full")
    g = full.graph
    clones = [op for op in g.ops if op.phase is Phase.BACKWARD and op.grad_of >= 0
              and g.ops[op.grad_of].phase is Phase.FORWARD
              and g.ops[op.grad_of].kind == op.kind
              and g.ops[op.grad_of].module_path == op.module_path
              and op.outputs != g.ops[op.grad_of].outputs]
    assert len(clones) >= len(g.ops) - len(plain.graph.ops) > 0
    for op in clones:
        assert (full.stage[op.id], full.chunk[op.id]) == \
            (full.stage[op.grad_of], full.chunk[op.grad_of])
    # a forward value a layer's backward still reads is made outside that layer
    made = {o: op for op in g.ops for o in op.outputs}
    for vid in _saved(full):
        src = made[vid]
        reader_layers = {op.module_path.split(".")[1] for op in g.ops
                         if op.phase is Phase.BACKWARD and vid in op.refs()
                         and op.module_path.startswith("blocks.")}
        assert not src.module_path.startswith("blocks.") or \
            src.module_path.split(".")[1] not in reader_layers or src.kind == "meshplan.transfer"
    assert len(_saved(full)) < len(_saved(plain)) / 4


def test_selective_keeps_matmul_outputs():
    sel = _job("selective")
    made = {o: op for op in sel.graph.ops for o in op.outputs}
    kinds = {made[v].kind for v in _saved(sel)}
    assert "aten.linear.default" in kinds and "aten.gelu.default" not in kinds


def test_bad_pattern_is_a_config_error():
    with pytest.raises(ConfigError, match="recompute pattern"):
        _job("full", recompute_pattern="nothing\\.here")


@pytest.mark.slow
def test_recompute_full_cuts_planned_activations_to_40_percent_gpt_small_pp2_m8():
    act = {}
    for mode in ("none", "full"):
        job = _job(mode, "small", mesh=(1, 2), tp=1, global_batch_size=8, micro_batch_size=1)
        act[mode] = [dict(lower(job, r).memory.peak)["activation"] for r in (0, 1)]
    assert max(act["full"]) <= 0.40 * max(act["none"]), act
    assert all(f < n for f, n in zip(act["full"], act["none"])), act


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_changes_no_loss_tp2_pp2(mode):
    cfg = model_config("gpt", "tiny")
    runs = {}
    for rc in ("none", mode):
        s = zoo_strategy("gpt", cfg, tp=2, pp=2, global_batch_size=8, micro_batch_size=2,
                         recompute=rc)
        runs[rc] = verify("gpt", "tiny", steps=5, mesh=Mesh(1, 4), strategy=s)
    diff = max(abs(a - b) for a, b in zip(runs["none"]["losses"], runs[mode]["losses"]))
    assert diff <= 1e-5 and runs[mode]["max_abs_diff"] <= 1e-4
    assert runs[mode]["ok"], runs[mode]["problems"]  # parameters and slots too
    planned = [v["planned_peak_bytes"] for v in runs[mode]["ranks"].values()]
    measured = [v["measured_peak_bytes"] for v in runs[mode]["ranks"].values()]
    assert all(m <= p for m, p in zip(measured, planned))
    assert max(measured) < max(v["measured_peak_bytes"] for v in runs["none"]["ranks"].values())
