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
"""

from __future__ import annotations

import math
import os

from meshplan.errors import PlanError
from meshplan.ir.fileio import read_sealed, seal, unseal, write_atomic
from meshplan.ir.graph import DType, Graph, Op, Phase, Ref, Role, TensorMeta, Update, Value

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
        "meta": [[k, v] for k, v in graph.meta],
        "grads": [[v, g] for v, g in graph.grads],
    }


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
            meta=tuple((_str(k), _str(v)) for k, v in d["meta"]),
            grads=tuple((_int(v), _int(g)) for v, g in d["grads"]),
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
