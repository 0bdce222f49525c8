"""Tensor parallelism a transformers model gets from its structure
(`capture/structure.py`: Megatron's pairs by module name) and what
propagation makes of it (`passes/propagate.py`): every block's pairs split,
a forward all-reduce per pair and nothing gathered inside the layers, and in
the backward one reduction per gradient however many Partial contributions
it sums."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from meshplan.driver.plan import plan_model  # noqa: E402
from meshplan.ir import Phase  # noqa: E402
from meshplan.ir.mesh import DERIVED, Mesh, Strategy  # noqa: E402

COMM = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def tp2_job(model_type: str):
    s = Strategy(tp=2, global_batch_size=8, micro_batch_size=8, layer_pattern=DERIVED,
                 tp_plan=DERIVED)
    return plan_model(f"hf:{model_type}", "tiny", Mesh(1, 2), s, "sgd").job


def in_layers(job):
    """The communication ops inside the layer lists: (phase, kind, ndim)."""
    g = job.graph
    lists = tuple(p + "." for p in g.facts.structure.layers.split(","))
    return [(op.phase, op.kind.split(".")[-1], len(g.values[op.args[0].id].meta.shape))
            for op in g.ops if op.kind.startswith("meshplan.")
            and op.kind.split(".")[-1] in COMM and op.module_path.startswith(lists)]


# pairs per block: BERT's attention.self.{query,key,value} with attention.output.dense
# and intermediate.dense with output.dense (two-part names); DistilBERT's and XLM's
# q_lin..out_lin; CTRL's Wq..dense; XLNet's ff.layer_1/layer_2; BigCode's c_fc/c_proj
# (its fused c_attn is not split: its output is q|k|v, not heads); BLOOM's MLP
PAIRS = {"bert": 2, "esm": 2, "distilbert": 2, "xlm": 1, "ctrl": 1, "xlnet": 1,
         "gpt_bigcode": 1, "bloom": 1}


@pytest.mark.parametrize("model_type", list(PAIRS))
def test_every_block_is_split_as_megatron_splits_it(model_type):
    job = tp2_job(model_type)
    comm = in_layers(job)
    layers = 4  # the tiny size
    assert [c for c in comm if c[1] != "all_reduce"] == []  # nothing gathered or exchanged
    forward = [c for c in comm if c[0] == Phase.FORWARD]
    assert len(forward) == PAIRS[model_type] * layers
    assert job.graph.facts.structure.tp_from.startswith("structure: Megatron's pairs")


# (forward, backward) all-reduces of activations inside the layers, Megatron's: one
# per pair each way; BART's decoder also reduces the encoder output's gradient from
# its 4 cross-attentions' k and v, once, summed
REDUCES = {"bert": (8, 8), "bart": (20, 21)}


@pytest.mark.parametrize("model_type", list(REDUCES))
def test_a_gradient_is_reduced_once_however_many_partials_it_sums(model_type):
    """Post-LN blocks: the attention's input gradient is the residual's
    (Replicate) plus q's, k's and v's (each Partial over tp): one all-reduce
    of their sum, not one per projection (bart tiny at tp2: 37 backward
    all-reduces in its layers before, 21 now)."""
    comm = in_layers(tp2_job(model_type))
    count = tuple(sum(1 for c in comm if c[0] == phase and c[2] > 1)
                  for phase in (Phase.FORWARD, Phase.BACKWARD))
    assert count == REDUCES[model_type]


@pytest.mark.parametrize("model_type", ["t5", "bart"])
def test_a_sums_share_of_a_value_from_another_stage_is_made_where_it_arrives(model_type):
    """At tp2·pp2·vpp2 a `grad_sum` on one stage shares a gradient that comes
    from another: the transfer carries it Replicate, and `local_partial` makes
    the share there (this plan used to stop on an AssertionError)."""
    s = Strategy(tp=2, pp=2, vpp=2, global_batch_size=8, micro_batch_size=2,
                 layer_pattern=DERIVED, tp_plan=DERIVED)
    g = plan_model(f"hf:{model_type}", "tiny", Mesh(1, 4), s, "sgd").job.graph
    made = {o: op for op in g.ops for o in op.outputs}
    shared = [op for op in g.ops if op.kind == "meshplan.local_partial"
              and made[op.args[0].id].kind == "meshplan.transfer"]
    assert shared
