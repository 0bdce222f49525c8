"""`assign_stages`: layers, the interleaved PP -> VPP layout, user layouts,
and the stage/chunk of every forward, backward and optimizer op."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

from meshplan.autodiff import build_train_step
from meshplan.capture import capture
from meshplan.errors import ConfigError
from meshplan.ir import Phase, Ref, Role
from meshplan.ir.kinds import ACCUMULATE_GRAD, GRAD_SUM, SGD
from meshplan.models import build_model, example_batch, model_config
from meshplan.passes.pipeline import StageAssignment, assign_stages

PATTERN = r"blocks\.(\d+)"


def _gpt_step(layers: int):
    cfg = model_config("gpt", "tiny", layers=layers)
    return build_train_step(capture(build_model(cfg), example_batch(cfg, 2)))


@pytest.fixture(scope="module")
def gpt():
    """Train steps of the tiny GPT by layer count, captured once each."""
    cache = {}

    def get(layers: int):
        if layers not in cache:
            cache[layers] = _gpt_step(layers)
        return cache[layers]

    return get


class Chain(nn.Module):
    """`inp`, then `blocks[i]` for i in `order`, each followed by a top-level tanh."""

    def __init__(self, order=(0, 1, 2, 3), tie: bool = False):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        if tie:
            self.blocks[3].weight = self.blocks[0].weight
        self.order = tuple(order)

    def forward(self, x):
        x = self.inp(x)
        for i in self.order:
            x = torch.tanh(self.blocks[i](x))
        return x.sum()


def _chain_step(**kw):
    return build_train_step(capture(Chain(**kw), (torch.randn(2, 4),)))


def _place(a: StageAssignment, op_id: int) -> tuple[int, int]:
    return a.stage[op_id], a.chunk[op_id]


# ---------------------------------------------------------------- layout


def test_four_layers_pp2_vpp2_interleave(gpt):
    a = assign_stages(gpt(4), pp=2, vpp=2, layer_pattern=PATTERN)
    assert a.layers == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert a.layer_stage == (0, 1, 0, 1)
    assert a.layer_chunk == (0, 0, 1, 1)
    assert a.num_chunks() == 2
    assert a.notes == ()


GRID = [(n, pp, v) for n in (4, 8, 12) for pp in (1, 2, 4) for v in (1, 2, 3)]


@pytest.mark.parametrize("n,pp,vpp", GRID)
def test_grid_round_robin_or_suggested_vpp(gpt, n, pp, vpp):
    g = gpt(n)
    if n % (pp * vpp):
        with pytest.raises(ConfigError) as e:
            assign_stages(g, pp, vpp, PATTERN)
        msg = str(e.value)
        assert f"{n} layers" in msg and f"{pp}*{vpp} = {pp * vpp}" in msg
        hint = ", or pass --stage-layers balanced for unequal ones"
        assert msg.endswith(hint) == (n >= pp * vpp)  # unequal segments, where there are enough
        listed = re.search(r"valid vpp values: ([\d, ]+?)(, or .*)?$", msg).group(1)
        assert [int(x) for x in listed.split(", ")] == \
            [v for v in range(1, n + 1) if n % (pp * v) == 0]
        return
    a = assign_stages(g, pp, vpp, PATTERN)
    per = n // (pp * vpp)
    assert a.layers == tuple(f"blocks.{i}" for i in range(n))
    assert a.layer_stage == tuple((i // per) % pp for i in range(n))
    assert a.layer_chunk == tuple((i // per) // pp for i in range(n))
    assert a.num_chunks() == vpp
    assert len(a.stage) == len(a.chunk) == len(g.ops)  # graph inputs get no entry


def test_pp_not_dividing_layers_lists_valid_pp(gpt):
    with pytest.raises(ConfigError, match=r"pp must divide the layer count") as e:
        assign_stages(gpt(4), pp=3, vpp=1, layer_pattern=PATTERN)
    assert str(e.value).endswith("valid pp values: 1, 2, 4, or pass --stage-layers balanced "
                                 "for unequal ones")


@pytest.mark.parametrize("pp,vpp", [(0, 1), (2, 0)])
def test_degrees_below_one_are_config_errors(gpt, pp, vpp):
    with pytest.raises(ConfigError, match="must both be >= 1"):
        assign_stages(gpt(4), pp, vpp, PATTERN)


# ---------------------------------------------------------------- every op


def _first_forward_reader(g) -> dict[int, int]:
    out: dict[int, int] = {}
    for op in g.ops_in(Phase.FORWARD):
        for r in op.refs():
            out.setdefault(r, op.id)
    return out


def _param_of(g, op) -> int:
    by_name = {v.name: v.id for v in g.inputs_by_role(Role.PARAM)}
    for r in op.refs():
        v = g.values[r]
        if v.role is Role.PARAM:
            return r
        if v.role is Role.GRAD:
            return by_name[v.name.removesuffix("@grad")]
    raise AssertionError(f"op {op.id} {op.kind} has no parameter input")


@pytest.mark.parametrize("pp,vpp", [(2, 2), (4, 2), (2, 1)])
def test_every_op_follows_its_rule(gpt, pp, vpp):
    g = gpt(8)
    a = assign_stages(g, pp, vpp, PATTERN)
    per = 8 // (pp * vpp)
    first, last = (0, 0), (pp - 1, vpp - 1)
    producer = {o: op.id for op in g.ops for o in op.outputs if o >= 0}
    reader = _first_forward_reader(g)
    in_layer = [op.id for op in g.ops_in(Phase.FORWARD) if re.match(PATTERN, op.module_path)]
    checked = {"fwd": 0, "bwd": 0, "sum": 0, "acc": 0, "opt": 0, "seed": 0}
    for op in g.ops:
        place = _place(a, op.id)
        assert 0 <= place[0] < pp and 0 <= place[1] < vpp
        m = re.match(PATTERN, op.module_path)
        if op.phase is Phase.FORWARD:
            checked["fwd"] += 1
            if op.module_path in ("wte", "wpe") or op.id < in_layer[0]:
                assert place == first           # embeddings, positions
            elif op.module_path in ("ln_f", "head") or op.id > in_layer[-1]:
                assert place == last            # head, loss
            else:
                seg = int(m.group(1)) // per
                assert place == (seg % pp, seg // pp)
        elif op.kind == GRAD_SUM:
            checked["sum"] += 1
            assert place == _place(a, max(producer[r] for r in op.refs()))
        elif op.phase is Phase.BACKWARD and op.grad_of >= 0:
            checked["bwd"] += 1
            assert place == _place(a, op.grad_of)
        elif op.kind == ACCUMULATE_GRAD or op.phase is Phase.OPTIMIZER:
            checked["acc" if op.kind == ACCUMULATE_GRAD else "opt"] += 1
            assert place == _place(a, reader[_param_of(g, op)])
        else:
            checked["seed"] += 1
            assert op.kind == "aten.full.default"  # the seed: with its first consumer
            assert place == _place(a, producer[g.loss]) == last
    assert all(checked.values()), checked
    assert len(set(zip(a.stage, a.chunk))) == pp * vpp


def test_ops_before_first_and_after_last_layer_and_between_layers():
    g = _chain_step()
    a = assign_stages(g, 2, 1, PATTERN)
    fwd = g.ops_in(Phase.FORWARD)
    # inp | b0 tanh | b1 tanh | b2 tanh | b3 tanh | sum
    assert [op.module_path for op in fwd][:3] == ["inp", "blocks.0", ""]
    assert [a.stage[op.id] for op in fwd] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]


def test_op_without_inputs_goes_with_its_first_consumer():
    g = _chain_step()
    a = assign_stages(g, 2, 1, PATTERN)
    seed = next(op for op in g.ops if op.phase is Phase.BACKWARD and op.grad_of < 0
                and op.kind == "aten.full.default")  # the loss seed: a factory
    assert not seed.refs()
    user = min(op.id for op in g.ops if seed.outputs[0] in op.refs())
    assert _place(a, seed.id) == _place(a, user) == (1, 0)


def test_accumulate_and_optimizer_follow_the_parameter_not_the_producer(gpt):
    # In a captured step the two coincide; rewire wte's accumulate and
    # optimizer ops to read a gradient made in the last segment to tell them apart.
    g = gpt(4)
    head_grad = next(op for op in g.ops if op.phase is Phase.BACKWARD
                     and op.module_path == "head").outputs[0]

    def rewire(op):
        if op.module_path != "wte" or op.phase is Phase.FORWARD or op.grad_of >= 0:
            return op
        return dataclasses.replace(op, args=op.args[:1] + (Ref(head_grad),) + op.args[2:])

    g2 = dataclasses.replace(g, ops=tuple(rewire(op) for op in g.ops))
    a = assign_stages(g2, 2, 2, PATTERN)
    moved = [op for op in g2.ops if op is not g.ops[op.id]]
    assert {op.kind for op in moved} == {ACCUMULATE_GRAD, SGD}
    assert _place(a, next(op.id for op in g.ops if op.module_path == "head")) == (1, 1)
    assert all(_place(a, op.id) == (0, 0) for op in moved)


# ---------------------------------------------------------------- user layouts


@pytest.mark.parametrize("user,chunks,counts", [
    ((0, 1, 1, 0), (0, 0, 0, 1), "stage 0: 2, stage 1: 1"),
    ((0, 1, 0, 1), (0, 0, 1, 1), "stage 0: 2, stage 1: 2"),
])
def test_non_monotone_user_stages_kept_with_chunks_by_runs(gpt, user, chunks, counts):
    g = gpt(4)
    a = assign_stages(g, 2, 1, PATTERN, layer_stages=user)
    assert a.layer_stage == user and a.layer_chunk == chunks
    assert len(a.notes) == 1 and "not monotone" in a.notes[0] and counts in a.notes[0]
    head = next(op for op in g.ops if op.module_path == "head")
    assert _place(a, head.id) == (user[-1], chunks[-1])


def test_monotone_user_stages_kept_uneven_without_vpp(gpt):
    a = assign_stages(gpt(4), 2, 1, PATTERN, layer_stages=(0, 0, 0, 1))
    assert a.layer_stage == (0, 0, 0, 1) and a.layer_chunk == (0, 0, 0, 0)
    assert a.num_chunks() == 1 and a.notes == ()


def test_monotone_user_stages_with_vpp_use_round_robin(gpt):
    a = assign_stages(gpt(4), 2, 2, PATTERN, layer_stages=(0, 0, 1, 1))
    assert a.layer_stage == (0, 1, 0, 1) and a.layer_chunk == (0, 0, 1, 1)
    assert len(a.notes) == 1 and "non-decreasing" in a.notes[0]


@pytest.mark.parametrize("user,pp,match", [
    ((0, 1, 1), 2, r"3 entries .* 4 layers.*exactly 4"),
    ((0, 1, 2, 1), 2, r"layer_stages\[2\] = 2 is outside \[0, 2\)"),
    ((0, 0, 0, 0), 2, r"no layer to stage\(s\) 1"),      # monotone, vpp=1
    ((0, 2, 2, 0), 3, r"no layer to stage\(s\) 1"),      # not monotone
])
def test_bad_user_stages_are_config_errors(gpt, user, pp, match):
    with pytest.raises(ConfigError, match=match):
        assign_stages(gpt(4), pp, 1, PATTERN, layer_stages=user)


# ---------------------------------------------------------------- errors


def test_non_contiguous_layer_is_config_error():
    g = _chain_step(order=(0, 1, 0))
    with pytest.raises(ConfigError, match=r"layer 'blocks\.0' is not contiguous") as e:
        assign_stages(g, 1, 1, PATTERN)
    assert "('blocks.1') runs in between" in str(e.value) and "\n" not in str(e.value)


def test_pattern_matching_nothing_is_config_error(gpt):
    with pytest.raises(ConfigError) as e:
        assign_stages(gpt(4), 2, 1, r"layers\.\d+")
    msg = str(e.value)
    assert r"'layers\.\d+'" in msg and "'wte'" in msg and "--layer-pattern" in msg


def test_invalid_regex_is_config_error(gpt):
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        assign_stages(gpt(4), 2, 1, "blocks.(")


def test_parameter_tied_across_stages_is_placed_with_its_first_reader():
    # passes/shared.py then gives the other stage its own copy (tests/passes/test_shared.py)
    g = _chain_step(tie=True)
    assert assign_stages(g, 1, 1, PATTERN).num_chunks() == 1  # one stage: fine
    a = assign_stages(g, 2, 1, PATTERN)
    w = next(v.id for v in g.inputs_by_role(Role.PARAM) if v.name == "blocks.0.weight")
    opt = next(op for op in g.ops if op.phase is Phase.OPTIMIZER and op.args[0] == Ref(w))
    assert a.stage[opt.id] == 0


class _Looped(nn.Module):
    """A block called twice (HRM's recurrent depth): blocks.0, blocks.1, blocks.0."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, y):
        for i in (0, 1, 0):
            x = torch.tanh(self.blocks[i](x))
        return nn.functional.mse_loss(x, y)


def test_a_layer_called_twice_trains_on_one_stage_and_is_refused_on_two():
    import meshplan.api as mp

    torch.manual_seed(0)
    model = _Looped()
    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(2)]
    graph = mp.capture(model, batches[0])
    one = mp.Strategy(global_batch_size=4, micro_batch_size=4, layer_pattern=PATTERN)
    job = mp.plan(graph, mp.Mesh(1, 1), one)
    assert job.layers == () and any("not contiguous" in n for n in job.notes), job.notes
    r = mp.verify(job, model, batches)
    assert r["ok"], r["problems"]
    with pytest.raises(ConfigError, match=r"layer 'blocks\.0' is not contiguous"):
        mp.plan(graph, mp.Mesh(1, 2), dataclasses.replace(one, pp=2, global_batch_size=8))
