"""Graph <-> JSON: lossless round trips, stable bytes, typed literals."""

import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.autodiff import build_train_step
from meshplan.capture import capture
from meshplan.errors import PlanError
from meshplan.ir import (
    ABSENT,
    DType,
    Graph,
    Op,
    Phase,
    Ref,
    Role,
    TensorMeta,
    Update,
    Value,
    check_well_formed,
)
from meshplan.ir.fileio import seal
from meshplan.ir.graph_facts import GraphFacts
from meshplan.ir.serialize import (
    KIND,
    VERSION,
    graph_from_bytes,
    graph_from_json,
    graph_to_bytes,
    graph_to_json,
    load_graph,
    save_graph,
)
from meshplan.models import build_model, example_batch, model_config

F32 = DType("float32")
LITERALS = (None, True, False, 0, 1, -7, 2**70, 1.0, -0.0, 0.1, 1e-300, 1e300,
            math.inf, -math.inf, math.nan, "", "1.0", "$ref", "ünï", DType("bfloat16"),
            (), (Ref(0), (Ref(1), 2, (None,)), "x"), (1, 1.0, True))


def small_graph() -> Graph:
    """Every role, phase and literal kind, kwargs and an ABSENT output."""
    roles = [r for r in Role if r is not Role.INTERNAL]
    values = [Value(i, TensorMeta((2, 3), F32), r, f"w{i}") for i, r in enumerate(roles)]
    n = len(values)
    values += [Value(n + i, TensorMeta(s, DType(d))) for i, (s, d) in
               enumerate([((2, 3), "float32"), ((), "float32"), ((4,), "int64"), ((), "bool"),
                          ((2, 3), "float32")])]
    ops = (
        Op(0, "aten.mul.Tensor", (Ref(0), Ref(1)) + LITERALS, (n,),
           kwargs=(("alpha", 1.0), ("dtype", F32), ("shape", (2, Ref(2)))),
           module_path="blocks.0.mlp", source="m.py, line 3: y = x * w"),
        Op(1, "aten.sum.default", (Ref(n),), (n + 1, ABSENT), phase=Phase.BACKWARD,
           grad_of=0),
        Op(2, "aten.neg.default", (Ref(n),), (n + 4,), phase=Phase.WEIGHT, grad_of=0),
        Op(3, "meshplan.sgd", (Ref(0), 0.5), (n + 2, n + 3), phase=Phase.OPTIMIZER),
    )
    return Graph(tuple(values), ops, tuple(range(n)), n + 1,
                 updates=(Update("w0", n + 2),),
                 facts=GraphFacts(model_class="Toy", aliases=(("w1", "w0"),)))


def same(a, b) -> bool:
    """Equality that also checks types, treats nan as equal and tells -0.0 from 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b))
    return a == b


def test_small_graph_round_trips_with_types():
    g = small_graph()
    check_well_formed(g)
    back = graph_from_bytes(graph_to_bytes(g))
    assert same(back.ops[0].args, g.ops[0].args)
    assert same(back.ops[0].kwargs, g.ops[0].kwargs)
    # nan != nan: compare the rest by value, and the bytes of a second trip
    assert _without_nan(back) == _without_nan(g)
    assert graph_to_bytes(back) == graph_to_bytes(g)
    assert back.ops[1].outputs == (g.ops[1].outputs[0], ABSENT)
    assert [op.phase for op in back.ops] == list(Phase)
    assert {v.role for v in back.values} == set(Role)


def _without_nan(g: Graph) -> Graph:
    op = g.ops[0]
    args = tuple(a for a in op.args if not (isinstance(a, float) and math.isnan(a)))
    return dataclasses.replace(g, ops=(dataclasses.replace(op, args=args),) + g.ops[1:])


def test_integral_float_stays_float_and_bool_stays_bool():
    args = graph_from_json(graph_to_json(small_graph())).ops[0].args
    lits = args[2:]
    assert [type(x) for x in lits] == [type(x) for x in LITERALS]
    assert type(lits[7]) is float and lits[7] == 1.0
    assert math.copysign(1, lits[8]) == -1.0  # -0.0 keeps its sign
    assert lits[1] is True and lits[3] == 0 and type(lits[3]) is int


def test_file_is_one_line_of_ascii_json():
    data = graph_to_bytes(small_graph())
    assert data.endswith(b"}\n") and data.count(b"\n") == 1
    data.decode("ascii")
    env = json.loads(data)
    assert (env["format"], env["version"]) == (KIND, VERSION)
    assert {"$float": "nan"} in env["body"]["ops"][0][2]


def test_save_and_load(tmp_path):
    g = dataclasses.replace(small_graph(), ops=small_graph().ops[1:2], updates=())
    path = tmp_path / "g.json"
    save_graph(g, path)
    assert load_graph(path) == g
    assert [p.name for p in tmp_path.iterdir()] == ["g.json"]


def test_non_ir_literal_is_a_plan_error():
    g = small_graph()
    bad = dataclasses.replace(g, ops=(dataclasses.replace(g.ops[0], args=([1, 2],)),))
    with pytest.raises(PlanError, match=r"op 0 aten.mul.Tensor .*list"):
        graph_to_bytes(bad)


def test_malformed_body_with_valid_checksum_is_a_plan_error():
    body = graph_to_json(small_graph())
    body["ops"][0][2].append({"$pickle": "x"})
    with pytest.raises(PlanError, match=r"^g\.json holds a malformed .*recompile it$"):
        graph_from_bytes(seal(KIND, VERSION, body), "g.json")
    body = graph_to_json(small_graph())
    body["values"][0][3] = "weights"
    with pytest.raises(PlanError, match="malformed"):
        graph_from_bytes(seal(KIND, VERSION, body))


@pytest.fixture(scope="module", params=["gpt", "resnet"])
def train_step(request):
    cfg = model_config(request.param, "tiny")
    return build_train_step(capture(build_model(cfg), example_batch(cfg, 2)))


def test_train_step_round_trips(train_step, tmp_path):
    path = tmp_path / "step.json"
    save_graph(train_step, path)
    back = load_graph(path)
    assert back == train_step
    assert graph_to_bytes(back) == path.read_bytes()


def _stable_digest(graph: Graph) -> str:
    """sha256 of the graph bytes (capture keeps no timings, so they are stable)."""
    return hashlib.sha256(graph_to_bytes(graph)).hexdigest()


_DIGEST_SCRIPT = """
import hashlib, torch
from meshplan.autodiff import build_train_step
from meshplan.capture import capture
from meshplan.ir import graph_to_bytes
from meshplan.models import build_model, example_batch, model_config
torch.manual_seed(0)
cfg = model_config("gpt", "tiny")
g = build_train_step(capture(build_model(cfg), example_batch(cfg, 2)))
print(hashlib.sha256(graph_to_bytes(g)).hexdigest())
"""


def test_bytes_identical_across_processes():
    """A fresh interpreter with another hash seed writes the same bytes as this one."""
    seed = "54321" if os.environ.get("PYTHONHASHSEED") == "12345" else "12345"
    child = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONHASHSEED": seed})
    assert child.returncode == 0, child.stderr[-2000:]
    torch.manual_seed(0)
    cfg = model_config("gpt", "tiny")
    here = _stable_digest(build_train_step(capture(build_model(cfg), example_batch(cfg, 2))))
    assert child.stdout.strip() == here


_names = st.text(max_size=8)
_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
    st.integers(min_value=0, max_value=10**6).map(Ref),
    st.sampled_from(["float32", "bfloat16", "int64", "bool"]).map(DType),
)
_lits = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=20)


@settings(max_examples=100, deadline=None)
@given(args=st.lists(_lits, max_size=6).map(tuple),
       kwargs=st.lists(st.tuples(_names, _lits), max_size=3).map(tuple))
def test_random_literals_round_trip(args, kwargs):
    g = Graph(values=(Value(0, TensorMeta((), F32), Role.DATA, "x"),),
              ops=(Op(0, "k", args, (ABSENT,), kwargs),), inputs=(0,), loss=0)
    data = graph_to_bytes(g)
    back = graph_from_bytes(data)
    assert same(back.ops[0].args, args)
    assert same(back.ops[0].kwargs, kwargs)
    assert graph_to_bytes(back) == data
