"""Context parallelism (issue 37): `--cp N` splits each sequence over N
ranks; attention computes its queries' rows against keys and values
gathered whole. Judged against eager (fp32 1e-5, losses and every
parameter), by the plan's structure, and against a planted bug."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from meshplan.cli.config_name import format_config_name, parse_config_name
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.errors import ConfigError
from meshplan.ir.choices import KernelVariant
from meshplan.ir.kinds import ALL_GATHER, ALL_TO_ALL
from meshplan.ir.mesh import Mesh
from meshplan.ir.sbp import Shard
from meshplan.ir.sequence_order import zigzag
from meshplan.lowering.check import check_plans
from meshplan.lowering.lower import lower
from meshplan.lowering.rankplan import line_axis
from meshplan.models import model_config
from meshplan.passes.context_parallel import ATTENTION
from tests.runtime._util import eager_verdict

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEQ = 256  # the GPT tiny at seq 256
LAYOUTS = {"cp2": dict(cp=2), "cp4": dict(cp=4), "cp2tp2sp": dict(cp=2, tp=2,
                                                                  sequence_parallel=True),
           "cp2pp2": dict(cp=2, pp=2), "dp2cp2": dict(dp=2, cp=2)}


def _job(model: str, fields: dict, seq: int | None = None, micro: int = 1, batch: int = 4):
    more = {"seq_len": seq} if seq else {}
    cfg = model_config(model, "tiny", **more)
    world = fields.get("dp", 1) * fields.get("cp", 1) * fields.get("tp", 1) * \
        fields.get("pp", 1)
    s = zoo_strategy(model, cfg, global_batch_size=batch, micro_batch_size=micro, **fields)
    return cfg, s, plan_model(model, "tiny", Mesh(1, world), s, "sgd", None, **more).job


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt_with_cp_trains_as_eager(layout):
    """The all-gather form (the ring, `auto`'s choice here, has its own below)."""
    cfg, s, job = _job("gpt", dict(LAYOUTS[layout], cp_attention="allgather"), SEQ)
    verdict = eager_verdict(job, cfg, 4)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, verdict["problems"]


@pytest.mark.parametrize("form", ["allgather", "alltoall"])
def test_each_attention_form_trains_as_eager(form):
    """`--cp-attention`: the all-gather form (each rank's query rows) and
    the all-to-all one (heads split, DeepSpeed Ulysses), at cp4."""
    cfg, s, job = _job("gpt", dict(cp=4, cp_attention=form), SEQ)
    attention = next(op for op in job.graph.ops if op.kind == ATTENTION[0])
    q = job.sbp[attention.args[0].id][s.cp_axis]
    assert q == (Shard(2) if form == "allgather" else Shard(1))
    verdict = eager_verdict(job, cfg, 4)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, verdict["problems"]


@pytest.mark.parametrize("model", ["bert", "hf:llama"])
def test_bidirectional_and_rotary_models_with_cp_train_as_eager(model):
    """BERT (no causal mask, learned positions) and Llama (rotary positions,
    transformers' own attention mask) at cp2."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    cfg, s, job = _job(model, dict(cp=2))
    verdict = eager_verdict(job, cfg, 4)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, verdict["problems"]


def test_several_samples_per_micro_batch_train_as_eager():
    """With 4 samples a micro-batch, the linear backward's flatten to
    (samples x tokens, features) cannot keep a sequence split: the plan
    sends those activations to a batch split first (all-to-all). Exact."""
    cfg, s, job = _job("gpt", dict(cp=2), micro=4)
    assert any(op.kind == ALL_TO_ALL for op in job.graph.ops)
    verdict = eager_verdict(job, cfg, 4)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, verdict["problems"]


def test_queries_stay_split_and_only_keys_and_values_are_gathered():
    """Each rank holds T/cp of every activation; a layer's forward gathers
    its keys and values (2 all-gathers over cp), and the step only the
    token ids besides (to put them in the load-balanced order); each
    attention's queries are its own rows, causal through CAUSAL_OFFSET."""
    cfg, s, job = _job("gpt", dict(cp=4, cp_attention="allgather"), SEQ)
    g, cp = job.graph, s.cp_axis
    attention = [op for op in g.ops if op.kind == ATTENTION[0] and op.phase.name == "FORWARD"]
    assert len(attention) == cfg.layers
    for op in attention:
        q, k = op.args[0].id, op.args[1].id
        assert job.sbp[q][cp] == Shard(2) and job.sbp[k][cp] != Shard(2)
        assert job.variant[op.id][cp] == KernelVariant.CAUSAL_OFFSET
    gathers = [op for op in g.ops if op.kind == ALL_GATHER and op.phase.name == "FORWARD"
               and dict(op.kwargs)["axis"] == cp]
    kv = [op for op in gathers if g.values[op.args[0].id].meta.dtype.name != "int64"]
    assert len(kv) == 2 * cfg.layers
    assert all(g.values[op.args[0].id].meta.shape[2] == SEQ for op in kv)
    assert {g.values[op.args[0].id].meta.shape for op in gathers if op not in kv} == {(1, SEQ)}
    plan = lower(job, 1)
    rows = Counter(b.shape for b in plan.buffers if len(b.shape) == 3)
    assert (1, SEQ // 4, cfg.hidden) in rows and (1, SEQ, cfg.hidden) not in rows


def test_a_plain_causal_kernel_on_query_rows_is_caught(monkeypatch):
    """Planted: the rank-dependent causal mask dropped (each rank's rows
    masked as if they were the sequence's first): eager disagrees."""
    from meshplan.runtime import bind

    monkeypatch.setitem(bind._VARIANTS, KernelVariant.CAUSAL_OFFSET,
                        lambda kernel, op, axis, ctx: kernel)
    cfg, s, job = _job("gpt", dict(cp=2, cp_attention="allgather"), 32)
    assert not eager_verdict(job, cfg, 4)["ok"]


RING = {"cp2": dict(cp=2), "cp4": dict(cp=4), "cp2tp2sp": dict(cp=2, tp=2, sequence_parallel=True),
        "cp2pp2": dict(cp=2, pp=2), "dp2cp2": dict(dp=2, cp=2),
        "cp2_in_order": dict(cp=2, cp_balance=False)}


@pytest.mark.parametrize("layout", list(RING))
def test_ring_attention_trains_as_eager(layout):
    """`--cp-attention ring`: every attention's queries, keys and values
    stay the rank's rows; the keys and values go around the cp ring inside
    the kernel (forward and backward), balanced or in order."""
    cfg, s, job = _job("gpt", dict(RING[layout], cp_attention="ring"), SEQ)
    rings = [op for op in job.graph.ops if job.variant[op.id][s.cp_axis] == KernelVariant.RING]
    assert len(rings) == 2 * cfg.layers  # each layer's forward and backward
    assert all(job.sbp[r][s.cp_axis] == Shard(2) for op in rings for r in op.refs())
    assert not any(op.kind == ALL_GATHER and dict(op.kwargs)["axis"] == s.cp_axis
                   and job.graph.values[op.args[0].id].meta.dtype.name != "int64"
                   for op in job.graph.ops)
    verdict = eager_verdict(job, cfg, 4)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, verdict["problems"]


@pytest.mark.parametrize("fields", [dict(zero=3), dict(zero=1, cp_attention="allgather"),
                                    dict(zero=2, recompute="full",
                                         recompute_pattern=r"blocks\.\d+")],
                         ids=["ring-zero3", "allgather-zero1", "ring-zero2-recompute"])
def test_cp_composes_with_zero_and_recompute(fields):
    """dp2·cp2 with ZeRO 1-3 (the weights' gradients reduced over dp and cp,
    their state sharded over dp) and full recompute (a recomputed ring is
    a ring of its own)."""
    cfg, s, job = _job("gpt", dict(dp=2, cp=2, **fields), SEQ)
    verdict = eager_verdict(job, cfg, 4)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, verdict["problems"]


def test_ring_attention_of_a_bidirectional_model_trains_as_eager():
    cfg, s, job = _job("bert", dict(cp=2, cp_attention="ring"))
    assert any(v[s.cp_axis] == KernelVariant.RING for v in job.variant)
    verdict = eager_verdict(job, cfg, 4)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, verdict["problems"]


@pytest.mark.parametrize("plant", ["source", "gradients"])
def test_a_ring_passing_the_wrong_block_is_caught(monkeypatch, plant):
    """Planted: the forward masks each block as another rank's (its keys'
    positions from the wrong neighbour), or the backward drops the key and
    value gradients arriving from the ring: eager disagrees."""
    from meshplan.runtime import ring_attention as ra

    if plant == "source":
        real = ra.ring_attention
        monkeypatch.setattr(ra, "ring_attention", lambda kernel, rows, keys, *rest: real(
            kernel, rows, keys[1:] + keys[:1], *rest))
    else:
        real_backward = ra.ring_attention_backward

        def lose_arrivals(kernel, rows, keys, me, shift, record):
            return real_backward(kernel, rows, keys, me, lambda x, step: (
                (lambda: torch.zeros_like(x)) if step % 2 else shift(x, step)), record)
        monkeypatch.setattr(ra, "ring_attention_backward", lose_arrivals)
    from meshplan.runtime import bind
    monkeypatch.setattr(bind, "ring_attention", ra.ring_attention)
    monkeypatch.setattr(bind, "ring_attention_backward", ra.ring_attention_backward)
    cfg, s, job = _job("gpt", dict(cp=4, cp_attention="ring"), 32)
    assert not eager_verdict(job, cfg, 4)["ok"]


def test_the_check_proves_each_ring_on_its_line_and_in_one_order():
    """A ring attention task's group is its cp line, and its place among
    the group's collectives is proven as theirs: a plan whose ring runs
    over another line, or whose two rings are swapped, fails the check."""
    cfg, s, job = _job("gpt", dict(cp=2, tp=2, cp_attention="ring"), 32)
    plans = {r: lower(job, r) for r in range(job.mesh.world)}
    assert check_plans(job, plans).ok
    rings = [i for i, t in enumerate(plans[0].tasks) if line_axis(t.variant) is not None]
    assert len(rings) == 2 * cfg.layers and all(
        plans[0].tasks[i].group == (0, 2) for i in rings)  # the cp line of rank 0 (dp, cp, tp)
    tasks = list(plans[0].tasks)
    tasks[rings[0]] = replace(tasks[rings[0]], group=(0, 1))
    bad = check_plans(job, {**plans, 0: replace(plans[0], tasks=tuple(tasks))})
    assert not bad.ok and any("runs over [0, 1]" in e for e in bad.errors), bad.errors
    tasks = list(plans[0].tasks)
    a, b = rings[0], rings[1]
    tasks[a], tasks[b] = tasks[b], tasks[a]
    swapped = check_plans(job, {**plans, 0: replace(plans[0], tasks=tuple(tasks))})
    assert not swapped.ok and any("collective order differs" in e for e in swapped.errors), \
        swapped.errors


def test_ring_needs_equal_blocks_and_says_which_attention_it_leaves():
    with pytest.raises(ConfigError, match="ring passes equal blocks"):
        _job("gpt", dict(cp=3, cp_balance=False, cp_attention="ring"), 50)
    pytest.importorskip("transformers")
    _, s, job = _job("hf:llama", dict(cp=2, cp_attention="ring"))
    assert any("taking the model's own mask (model.model.layers.0.self_attn" in n
               for n in job.notes), job.notes


def test_planned_activations_fall_with_cp():
    """GPT small at seq 2048 (the issue's bar: cp2's activations at most
    0.55x of cp1's): the planned activation peak per rank, cp1, cp2, cp4."""
    peaks = {}
    for cp in (1, 2, 4):
        cfg = model_config("gpt", "small", seq_len=2048)
        s = zoo_strategy("gpt", cfg, cp=cp, global_batch_size=1, micro_batch_size=1)
        job = plan_model("gpt", "small", Mesh(1, cp), s, "adamw", None, seq_len=2048).job
        peaks[cp] = dict(lower(job, 0).memory.peak)["activation"]
    assert peaks[2] <= 0.55 * peaks[1] and peaks[4] <= 0.3 * peaks[1], peaks


@pytest.mark.parametrize("layout", [["--cp", "2"], ["--cp", "2", "--tp", "2",
                                                  "--sequence-parallel", "--cp-attention",
                                                  "ring"]])
def test_verify_context_parallel_on_processes(capsys, layout):
    """`meshplan verify --cp 2 --dp 2`, and the ring with tp2 and sequence
    parallelism (its shifts on gloo's point-to-point), on 4 gloo processes."""
    from meshplan.cli.main import main

    code = main(["verify", "--model", "gpt", "--devices-per-node", "4", *layout,
                 "--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "1",
                 "--seq-len", "64", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert '"ok": true' in out


def test_no_attention_to_split_and_cp_with_ep_are_one_line():
    with pytest.raises(ConfigError, match="no scaled_dot_product_attention"):
        _job("resnet", dict(cp=2))
    with pytest.raises(ConfigError, match="with expert parallelism"):
        _job("moe", dict(dp=2, ep=2, cp=2))


def test_configuration_names_carry_cp():
    name = "gpt_nl4_nah4_hs64_FP32_acfalse_mp2_pp1_ep2_cp2_zero1_mb1_gb8_1n8g"
    f = parse_config_name(name, ("gpt", "moe"))
    assert (f["cp"], f["ep"], f["zero"]) == (2, 2, 1)
    assert format_config_name(f) == name
    plain = parse_config_name("gpt_nl4_nah4_hs64_FP32_acfalse_mp2_pp1_cp4_mb1_gb8_1n8g")
    assert plain["cp"] == 4 and plain["ep"] == 1


@pytest.mark.parametrize("seq, cp", [(16, 2), (256, 4), (24, 3)])
def test_zigzag_gives_each_rank_a_head_and_a_tail_chunk(seq, cp):
    order = zigzag(seq, cp)
    assert sorted(order) == list(range(seq))
    c, part = seq // (2 * cp), seq // cp
    for r in range(cp):
        mine = order[r * part:(r + 1) * part]
        assert mine == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c,
                                                            (2 * cp - r) * c)]


def _attention_flops(balance: bool, form: str = "ring") -> list[float]:
    from meshplan.costmodel import load_device_model
    from meshplan.lowering.action_times import attention_flops

    _, s, job = _job("gpt", dict(cp=4, cp_balance=balance, cp_attention=form), SEQ)
    assert job.strategy.cp_balance is balance
    return [attention_flops(job, lower(job, r), load_device_model("h100-80gb"))
            for r in range(4)]


def test_causal_attention_work_is_balanced_over_cp_ranks():
    """cp4, causal, the ring: each rank's attention flops from its plan (the
    pairs its blocks see) within 5% of each other; in order, the last rank
    does 7x the first's (1, 3, 5, 7 eighths of a row's keys). The all-gather
    form's masked kernel computes every pair of its rows and keys, in either
    order: equal, and about twice the ring's."""
    balanced, in_order = _attention_flops(True), _attention_flops(False)
    assert max(balanced) <= 1.05 * min(balanced), balanced
    assert max(in_order) / min(in_order) == pytest.approx(7, rel=0.1), in_order
    assert sum(balanced) == pytest.approx(sum(in_order), rel=1e-9)
    gathered = _attention_flops(True, "allgather")
    assert gathered == _attention_flops(False, "allgather") and len(set(gathered)) == 1
    assert sum(gathered) == pytest.approx(2 * sum(balanced), rel=0.02)


def test_auto_takes_the_ring_for_a_balanced_causal_sequence():
    """`--cp-attention auto` (the default): a load-balanced causal sequence
    takes the ring (half the all-gather form's attention work, balanced);
    a bidirectional one the cheaper of the all-gather and all-to-all forms."""
    _, s, job = _job("gpt", dict(cp=2), SEQ)
    assert any(v[s.cp_axis] == KernelVariant.RING for v in job.variant)
    _, s, job = _job("bert", dict(cp=2))
    assert not any(v[s.cp_axis] == KernelVariant.RING for v in job.variant)


def test_in_order_trains_as_eager_and_a_sequence_2cp_does_not_divide_is_one_line():
    cfg, s, job = _job("gpt", dict(cp=3, cp_balance=False), 48)
    verdict = eager_verdict(job, cfg, 4)
    assert verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, verdict["problems"]
    with pytest.raises(ConfigError, match="2 x cp = 6 chunks, which do not divide its 40"):
        _job("gpt", dict(cp=3), 40)


def test_a_model_reading_neighbouring_positions_stays_in_order_and_says_so():
    """transformers' causal LMs shift their labels inside the model (a pad
    and a slice along the sequence): reordered, a token would be scored
    against another's label, so the sequence stays in order, with a note."""
    pytest.importorskip("transformers")
    _, s, job = _job("hf:llama", dict(cp=2))
    assert job.strategy.cp_balance is False
    assert any(n.startswith("cp: the sequence is split in order") for n in job.notes)


class Flipped(torch.nn.Module):
    """Attention with a causal mask (transformers' form) between two
    reversals (`flip`, an op with no split rule: it runs whole)."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, ids, labels):
        h = self.emb(ids).flip(1)
        q, k, v = self.qkv(h).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).flip(2)
        out = self.head(a.transpose(1, 2).reshape(*ids.shape, 16))
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten())


def test_attention_whose_queries_arrive_whole_names_the_op_that_made_them_whole():
    import meshplan.api as mp

    ids = torch.randint(0, 32, (2, 16))
    graph = mp.capture(Flipped(), (ids, ids))
    with pytest.raises(ConfigError) as e:
        mp.plan(graph, Mesh(1, 2), mp.Strategy(cp=2, global_batch_size=2, micro_batch_size=2))
    assert "\n" not in str(e.value) and "gets its queries whole (aten.flip.default" in str(e.value)
