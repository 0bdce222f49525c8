"""`Graph` <-> JSON, losslessly, and graph files (format "meshplan.graph" v1).

Invariants:
- `graph_from_json(graph_to_json(g)) == g` for every graph whose literals
  are IR literals; types survive: a bool stays bool, 1 stays int, 1.0 stays
  float, a tuple stays a tuple (JSON lists decode as tuples everywhere).
- Literals: None, bool, int, str and finite floats are JSON natives (Python's
  json writes a float by its shortest repr, so 1.0 and -0.0 read back as the
  same float). Tagged forms, the only JSON objects among literals:
  `{"$ref": id}`, `{"$dtype": "float32"}`, `{"$float": "inf"|"-inf"|"nan"}`.
- The body is rows of arrays, columns in a fixed order (the `*_COLUMNS`
  names below); enums (`Phase`, `Role`) are written by `.value`.
- Files are sealed (`fileio`): atomic, versioned, checksummed, no pickle.
  A change to this layout bumps `VERSION`.
- `GraphFacts` are written as the string pairs they were before they were
  typed (`facts_to_pairs`, in the order the passes add them), so graph and
  Job bytes do not change; `facts_from_pairs` reads exactly that form back,
  and imports the modules that register the graph's custom ops.
"""

from __future__ import annotations

import importlib
import json
import math
import os

from meshplan.errors import PlanError
from meshplan.ir.choices import NonFinite, OptimizerKind, Precision
from meshplan.ir.fileio import read_sealed, seal, unseal, write_atomic
from meshplan.ir.graph import DType, Graph, Op, Phase, Ref, Role, TensorMeta, Update, Value
from meshplan.ir.graph_facts import GraphFacts, Structure, TrainFacts
from meshplan.ir.lr_schedule import LrSchedule
from meshplan.ir.optimizer_config import OptimizerConfig

KIND = "meshplan.graph"
VERSION = 1
VALUE_COLUMNS = ("id", "shape", "dtype", "role", "name")
OP_COLUMNS = ("id", "kind", "args", "outputs", "kwargs", "phase", "module_path", "source",
              "grad_of")
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class Malformed(Exception):
    """A body that passed its checksum but does not decode (a writer bug)."""


def graph_to_json(graph: Graph) -> dict:
    """The JSON body of `graph`: JSON types only, finite floats only."""
    return {
        "values": [[v.id, list(v.meta.shape), v.meta.dtype.name, v.role.value, v.name]
                   for v in graph.values],
        "ops": [op_to_row(op) for op in graph.ops],
        "inputs": list(graph.inputs),
        "loss": graph.loss,
        "updates": [[u.name, u.value] for u in graph.updates],
        "meta": facts_to_pairs(graph.facts),
        "grads": [[v, g] for v, g in graph.grads],
        # only when there are any, so every graph without keeps its bytes
        **({"reports": [[n, v] for n, v in graph.reports]} if graph.reports else {}),
    }


ALIAS = "alias:"  # ("alias:head.weight", "wte.weight")
AUTO = "auto:"  # `Structure`'s fields, in field order
OP_MODULE = "op_module"  # one pair per module that registers a custom op


def facts_to_pairs(f: GraphFacts) -> list[list[str]]:
    """`f` as [key, string] pairs: numbers by str (the loss scale by repr),
    the tp entries, the optimizer's config and the lr schedule as JSON."""
    out = [] if f.model_class is None else [["model_class", f.model_class]]
    out += [[ALIAS + a, name] for a, name in f.aliases]
    if (s := f.structure) is not None:
        out += [[AUTO + k, v] for k, v in (
            ("layers", s.layers), ("layers_from", s.layers_from),
            ("tp", json.dumps([list(e) for e in s.tp])), ("tp_from", s.tp_from),
            ("heads", str(s.heads)), ("kv_heads", str(s.kv_heads)), ("vocab", str(s.vocab)),
            ("model", s.model))]
    if f.precision != Precision.FP32:
        out.append(["precision", str(f.precision)])
    if f.captured_for != Precision.FP32:
        out.append(["captured_for", str(f.captured_for)])
    if (t := f.train) is not None:
        out += [["optimizer", str(t.optimizer)], ["num_microbatches", str(t.num_microbatches)],
                ["optimizer_config", t.optimizer_config.to_json()]]
        if t.on_nonfinite is not None:
            out.append(["on_nonfinite", str(t.on_nonfinite)])
        if t.lr_schedule is not None:
            out.append(["lr_schedule", t.lr_schedule[0].to_meta(t.lr_schedule[1])])
        if t.loss_scale is not None:
            out.append(["loss_scale", repr(float(t.loss_scale))])
    out += [[OP_MODULE, m] for m in f.op_modules]
    return out


def facts_from_pairs(pairs) -> GraphFacts:
    """The `GraphFacts` that `facts_to_pairs` wrote as `pairs` (`Malformed`
    unless writing them again gives `pairs`: no key is lost or reordered)."""
    rows = [[_str(k), _str(v)] for k, v in _list(pairs)]
    d = dict(rows)
    auto = {k[len(AUTO):]: v for k, v in rows if k.startswith(AUTO)}
    structure = None if not auto else Structure(
        auto["layers"], auto["layers_from"], tuple(tuple(e) for e in json.loads(auto["tp"])),
        auto["tp_from"], int(auto["heads"]), int(auto["kv_heads"]), int(auto["vocab"]),
        auto["model"])
    train = None if "optimizer" not in d else TrainFacts(
        OptimizerKind(d["optimizer"]), int(d["num_microbatches"]),
        OptimizerConfig.from_json(d["optimizer_config"]),
        NonFinite(d["on_nonfinite"]) if "on_nonfinite" in d else None,
        LrSchedule.from_meta(d["lr_schedule"]) if "lr_schedule" in d else None,
        float(d["loss_scale"]) if "loss_scale" in d else None)
    facts = GraphFacts(d.get("model_class"),
                       tuple((k[len(ALIAS):], v) for k, v in rows if k.startswith(ALIAS)),
                       structure, Precision(d.get("precision", Precision.FP32)), train,
                       tuple(v for k, v in rows if k == OP_MODULE),
                       Precision(d.get("captured_for", Precision.FP32)))
    if facts_to_pairs(facts) != rows:
        raise Malformed(f"graph facts {[k for k, _ in rows]} are not in the written form")
    for module in facts.op_modules:  # the graph's custom ops exist here once imported
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise PlanError(f"the graph's custom ops are registered by module {module!r}, "
                            f"which this process cannot import ({e}); put it on PYTHONPATH "
                            "where the ranks run") from None
    return facts


def op_to_row(op: Op) -> list:
    """An op as a JSON row, columns `OP_COLUMNS`."""
    try:
        args = [_lit_to_json(a) for a in op.args]
        kwargs = [[k, _lit_to_json(v)] for k, v in op.kwargs]
    except TypeError as e:
        raise PlanError(f"cannot serialize op {op.id} {op.kind} ({op.module_path or '<root>'}): "
                        f"{e}; the IR allows only None, bool, int, float, str, DType, Ref "
                        "and tuples of these as arguments") from None
    return [op.id, op.kind, args, list(op.outputs), kwargs, op.phase.value, op.module_path,
            op.source, op.grad_of]


def _lit_to_json(a):
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        if math.isfinite(a):
            return a
        return {"$float": "nan" if math.isnan(a) else ("inf" if a > 0 else "-inf")}
    if isinstance(a, Ref):
        return {"$ref": a.id}
    if isinstance(a, DType):
        return {"$dtype": a.name}
    if isinstance(a, tuple):
        return [_lit_to_json(x) for x in a]
    raise TypeError(f"literal {a!r:.60} of type {type(a).__name__}")


def graph_from_json(d: dict, where: str = "<json>") -> Graph:
    """Rebuild the `Graph` that `graph_to_json` encoded.

    Raises `PlanError` naming `where` when `d` is not such an encoding."""
    try:
        return Graph(
            values=tuple(_value_from_json(row) for row in d["values"]),
            ops=tuple(op_from_row(row) for row in d["ops"]),
            inputs=tuple(_int(i) for i in d["inputs"]),
            loss=_int(d["loss"]),
            updates=tuple(Update(_str(n), _int(v)) for n, v in d["updates"]),
            facts=facts_from_pairs(d["meta"]),
            grads=tuple((_int(v), _int(g)) for v, g in d["grads"]),
            reports=tuple((_str(n), _int(v)) for n, v in d.get("reports", ())),
        )
    except (Malformed, KeyError, TypeError, ValueError, RecursionError) as e:
        raise PlanError(f"{where} holds a malformed {KIND} v{VERSION} body ({type(e).__name__}: "
                        f"{str(e)[:80]}); recompile it") from None


def _value_from_json(row) -> Value:
    vid, shape, dtype, role, name = row
    meta = TensorMeta(tuple(_int(s) for s in shape), DType(_str(dtype)))
    return Value(_int(vid), meta, Role(role), _str(name))


def op_from_row(row) -> Op:
    """The op a row of `op_to_row` encodes (`Malformed` if it is not one)."""
    oid, kind, args, outputs, kwargs, phase, module_path, source, grad_of = row
    if type(oid) is not int or type(grad_of) is not int:
        raise Malformed(f"expected int ids, got {oid!r:.20} and {grad_of!r:.20}")
    return Op(
        id=oid,
        kind=_str(kind),
        args=_lits(args),
        outputs=tuple(_int(o) for o in outputs),
        kwargs=tuple((_str(k), _lit_from_json(v)) for k, v in _list(kwargs)),
        phase=_PHASES[phase],
        module_path=_str(module_path),
        source=_str(source),
        grad_of=grad_of,
    )


_PHASES = {p.value: p for p in Phase}
_PLAIN = (type(None), bool, int, float, str)


def _lits(args) -> tuple:
    """A row's argument list as a tuple of literals (plain values fast)."""
    return tuple(a if type(a) in _PLAIN else _lit_from_json(a) for a in _list(args))


def _lit_from_json(a):
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, list):
        return _lits(a)
    if isinstance(a, dict) and len(a) == 1:
        (tag, x), = a.items()
        if tag == "$ref":
            return Ref(_int(x))
        if tag == "$dtype":
            return DType(_str(x))
        if tag == "$float" and x in _NON_FINITE:
            return _NON_FINITE[x]
    raise Malformed(f"unknown literal {a!r:.60}")


def _int(x) -> int:
    if type(x) is not int:
        raise Malformed(f"expected an int, got {x!r:.40}")
    return x


def _str(x) -> str:
    if not isinstance(x, str):
        raise Malformed(f"expected a string, got {x!r:.40}")
    return x


def _list(x) -> list:
    if not isinstance(x, list):
        raise Malformed(f"expected a list, got {x!r:.40}")
    return x


def graph_to_bytes(graph: Graph) -> bytes:
    """The sealed file contents of `graph`; equal graphs give equal bytes."""
    return seal(KIND, VERSION, graph_to_json(graph))


def graph_from_bytes(data: bytes, where: str = "<bytes>") -> Graph:
    """Read what `graph_to_bytes` wrote; `PlanError` naming `where` if unreadable."""
    return graph_from_json(unseal(data, KIND, VERSION, where), where)


def save_graph(graph: Graph, path: str | os.PathLike) -> None:
    """Write `graph` to `path` atomically."""
    write_atomic(path, graph_to_bytes(graph))


def load_graph(path: str | os.PathLike) -> Graph:
    """Read a graph file written by `save_graph`."""
    return graph_from_json(read_sealed(path, KIND, VERSION), str(path))
