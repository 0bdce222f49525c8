"""The Job: the logical train step, placed, laid out, boxed and staged.

Invariants:
- Per op: `stage[i]`, `chunk[i]` and `variant[i]` (the rank-dependent kernel
  variant per mesh axis, "" if none). Per value: `sbp[v]`, its layout on
  the (dp, tp) grid of the stage that produces it. `temps`: the kernel
  workspace bytes of every distinct local signature of the Job's ops, worked
  out once by the master (`passes/temps.py`), so that no rank infers them.
- Every op's inputs are on its own stage in the layout it needs: the only
  cross-stage edges are `meshplan.transfer` ops.
- The Job is deterministic: the same inputs give byte-identical `to_bytes`
  and the same `digest`, in any process.
- Bytes (format "meshplan.job" v3, `fileio.seal_parts`): a head (mesh,
  strategy, temps, the values that update a state); the rest of the graph
  (inputs, the data inputs in batch order, the `RANK_WIDE` inputs' values,
  updates by name, meta, gradient links); per stage, its ops and
  the values its view reads (values on a stage boundary are in both); the
  transfers; and the values no op touches. `digest` is the sha256 of the
  body, hashed once: when the Job is written or read. `JobReader.view`
  decodes only what one stage's ranks read: the head, the "graph" part
  (inputs, updates, facts: a few entries per state), the transfers, and
  that stage's ops and values; `JobReader.states` adds the other stages'
  value rows, for the one rank that writes a checkpoint's manifest.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from meshplan.errors import PlanError
from meshplan.ir.fileio import Parts, encode_part, open_parts, sealed_parts
from meshplan.ir.gc_pause import paused_gc
from meshplan.ir.graph import RANK_WIDE, DType, Graph, Op, Role, TensorMeta, Update, Value
from meshplan.ir.graph_facts import GraphFacts
from meshplan.ir.kinds import TRANSFER
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.ir.sbp import NdSbp, Partial, Replicate, Sbp, Shard, fmt
from meshplan.ir.serialize import (
    Malformed,
    facts_from_pairs,
    facts_to_pairs,
    op_from_row,
    op_to_row,
)

KIND = "meshplan.job"
VERSION = 3  # v3: the "graph" part holds the data inputs' order and the rank-wide values


@dataclass(frozen=True, slots=True)
class Job:
    graph: Graph
    mesh: Mesh
    strategy: Strategy
    stage: tuple[int, ...]
    chunk: tuple[int, ...]
    sbp: tuple[NdSbp, ...]
    variant: tuple[tuple[str, ...], ...]
    layers: tuple[str, ...] = ()
    layer_stage: tuple[int, ...] = ()
    layer_chunk: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    temps: tuple[tuple[str, int], ...] = ()
    # The sealed bytes, once made or read (a memo: the Job is immutable).
    _sealed: Parts | None = field(default=None, init=False, repr=False, compare=False)

    def _parts(self) -> Parts:
        """The serialized Job, encoded once."""
        if self._sealed is None:
            with paused_gc():
                object.__setattr__(self, "_sealed", _encode(self))
        assert self._sealed is not None
        return self._sealed

    def to_bytes(self) -> bytes:
        return self._parts().data

    def digest(self) -> str:
        """sha256 of the serialized Job's body: the cache key of every rank's plan."""
        return self._parts().digest

    @staticmethod
    def from_bytes(data: bytes, where: str = "<bytes>") -> Job:
        return JobReader(data, where).job()

    def view(self, stage: int) -> StageView:
        """What lowering a rank of `stage` reads: the same view as
        `StageView.from_bytes(self.to_bytes(), stage)`."""
        g = self.graph
        ids = [op.id for op in g.ops
               if self.stage[op.id] == stage or op.kind == TRANSFER
               and dict(op.kwargs)["src_stage"] == stage]
        return _view(self.mesh, self.strategy, stage, self.digest(), dict(self.temps),
                     _Whole(g.inputs, _data_ids(g),
                            tuple((g.values[v], self.sbp[v]) for v in _rank_wide(g)), g.loss,
                            tuple((u.name, u.value) for u in g.updates), g.facts, g.reports),
                     [(g.ops[i], self.stage[i], self.chunk[i], self.variant[i]) for i in ids],
                     lambda v: (g.values[v], self.sbp[v]))

    def states(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every state's (shape, dtype name), by name (`JobReader.states`)."""
        return _states(self.graph.values)


@dataclass(frozen=True)
class StageView:
    """The part of a Job that a rank of `stage` reads, to lower its plan and
    to run it, by id: the stage's ops and every transfer into or out of it
    (in Job order), their stage, chunk and kernel variant, the values they
    read or write with their layouts, which of them update a state in
    place, the graph inputs among them, the data inputs' batch order, the
    loss id, the graph's facts and the Job's temps. Read-only mappings."""

    mesh: Mesh
    strategy: Strategy
    stage: int
    digest: str
    ops: tuple[Op, ...]
    op_stage: dict[int, int]
    op_chunk: dict[int, int]
    op_variant: dict[int, tuple[str, ...]]
    values: dict[int, Value]
    sbp: dict[int, NdSbp]
    updates: frozenset[int]
    temps: dict[str, int]
    # state name -> the value of its update, for the updates among `values`
    finals: dict[str, int]
    inputs: tuple[int, ...]  # the graph inputs among `values`, in the graph's order
    # (`values` holds the graph's `RANK_WIDE` inputs on every stage)
    data: tuple[int, ...]    # every DATA input of the graph, in batch order (some not here)
    loss: int                # the graph's loss value id (in `values` on the last stage)
    facts: GraphFacts
    op_of: dict[int, Op]     # `ops` by id
    reports: tuple[tuple[str, int], ...] = ()  # the graph's reports among `values`

    def inputs_by_role(self, role: Role) -> tuple[Value, ...]:
        return tuple(self.values[i] for i in self.inputs if self.values[i].role is role)

    def names_of(self, name: str) -> tuple[str, ...]:
        """`name` (a graph input's) and its aliases (`Graph.names_of`)."""
        return (name, *sorted(a for a, c in self.facts.aliases if c == name))

    @staticmethod
    def from_bytes(data: bytes, stage: int, where: str = "<bytes>") -> StageView:
        """Decode only `stage`'s part of the Job in `data`."""
        return JobReader(data, where).view(stage)


class JobReader:
    """A Job's bytes, checked once (one hash over the raw bytes), then
    decoded part by part on demand: the head at once, the transfers when a
    view first needs them, a stage's ops and values for its view."""

    def __init__(self, data: bytes, where: str = "<bytes>"):
        self.parts = open_parts(data, KIND, VERSION, where)
        self.digest, self.where = self.parts.digest, where
        with _Reading(where):
            self.head = self.parts.load("head")
            self.mesh, self.strategy = Mesh(**self.head["mesh"]), _strategy(self.head["strategy"])
        self._transfers: list | None = None
        self._whole: _Whole | None = None

    def view(self, stage: int) -> StageView:
        """What a rank of `stage` reads (equal to `Job.view(stage)`)."""
        with _Reading(self.where):
            if self._transfers is None:
                self._transfers = self.parts.load("transfers")
            if self._whole is None:
                rest = self.parts.load("graph")
                self._whole = _Whole(tuple(rest["inputs"]), tuple(rest["data"]),
                                     tuple(_value(r) for r in rest["rank_wide"]),
                                     self.head["loss"],
                                     _pairs(rest["updates"]), facts_from_pairs(rest["meta"]),
                                     _pairs(rest.get("reports", ())))
            own = f"ops/{stage}"
            rows = [(r, stage) for r in self.parts.load(own)] if own in self.parts else []
            rows += [(r[:-1], r[-1]) for r in self._transfers
                     if stage in (r[-1], _src_stage(r))]
            rows.sort(key=lambda x: x[0][0])
            own_values = f"values/{stage}"
            rows_v = self.parts.load(own_values) if own_values in self.parts else []
            values = {r[0]: r for r in rows_v}
            return _view(self.mesh, self.strategy, stage, self.digest,
                         dict(_pairs(self.head["temps"])), self._whole,
                         [(op_from_row(r[:9]), st, r[9], tuple(r[10])) for r, st in rows],
                         lambda v: _value(values[v]))

    def states(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every state's (shape, dtype name), by name: the value rows of every
        stage decoded, the ops not (a checkpoint manifest's writer)."""
        with _Reading(self.where):
            rows = {r[0]: r for name in self.parts.index if name.startswith("values/")
                    for r in self.parts.load(name) if r[3] in _STATE_ROLES}
            return _states(_value(r)[0] for r in rows.values())

    def job(self) -> Job:
        """The whole Job."""
        with _Reading(self.where):
            job = _decode(self.parts, self.head, self.mesh, self.strategy)
        object.__setattr__(job, "_sealed", self.parts)
        return job


class _Reading:
    """Turns any decoding failure into one `PlanError` naming the file, and
    pauses the garbage collector meanwhile (`ir.gc_pause`)."""

    def __init__(self, where: str):
        self.where = where
        self.pause = paused_gc()

    def __enter__(self):
        self.pause.__enter__()
        return self

    def __exit__(self, kind, e, tb):
        self.pause.__exit__(None, None, None)
        if kind is not None and issubclass(kind, (Malformed, KeyError, TypeError, ValueError,
                                                  IndexError, AttributeError)):
            raise PlanError(f"{self.where} holds a malformed {KIND} v{VERSION} body "
                            f"({kind.__name__}: {str(e)[:80]}); recompile it") from None
        return False


@dataclass(frozen=True, slots=True)
class _Whole:
    """What every stage's view shares: the graph's inputs, its data inputs,
    the `RANK_WIDE` inputs' values and layouts, its loss, its updates
    (state name, value), and its facts."""

    inputs: tuple[int, ...]
    data: tuple[int, ...]
    rank_wide: tuple[tuple[Value, NdSbp], ...]  # in every view
    loss: int
    # (state name, the value that updates it); a tied parameter's name once per stage
    updates: tuple[tuple[str, int], ...]
    facts: GraphFacts
    reports: tuple[tuple[str, int], ...] = ()


def _view(mesh, strategy, stage, digest, temps, whole: _Whole, ops, value_of) -> StageView:
    """A StageView from (op, stage, chunk, variant) in Job order; `value_of(v)`
    gives (Value, sbp) for each value the ops touch."""
    values, sbp = {v.id: v for v, _ in whole.rank_wide}, {v.id: s for v, s in whole.rank_wide}
    for op, *_ in ops:
        for v in op.refs() + op.outputs:
            if v >= 0 and v not in values:
                values[v], sbp[v] = value_of(v)
    mine = [(n, v) for n, v in whole.updates if v in values]
    return StageView(mesh, strategy, stage, digest, tuple(o[0] for o in ops),
                     {o[0].id: o[1] for o in ops}, {o[0].id: o[2] for o in ops},
                     {o[0].id: o[3] for o in ops}, values, sbp,
                     frozenset(v for _, v in mine), temps, dict(mine),
                     tuple(i for i in whole.inputs if i in values), whole.data, whole.loss,
                     whole.facts,
                     {o[0].id: o[0] for o in ops},
                     tuple((n, v) for n, v in whole.reports if v in values))


def _rank_wide(g: Graph) -> tuple[int, ...]:
    """The graph's `RANK_WIDE` inputs."""
    return tuple(v for v in g.inputs if g.values[v].name in RANK_WIDE)


def _data_ids(g: Graph) -> tuple[int, ...]:
    """The graph's DATA inputs, in the order a batch holds them."""
    return tuple(v.id for v in g.inputs_by_role(Role.DATA))


def stage_view(job: Job | StageView, stage: int) -> StageView:
    """`job`'s view of `stage` (a view of that stage is itself)."""
    if isinstance(job, StageView):
        assert job.stage == stage, f"a view of stage {job.stage}, not of {stage}"
        return job
    return job.view(stage)


_STATE_ROLES = frozenset(r.value for r in (Role.PARAM, Role.BUFFER, Role.OPT_STATE))


def _states(values) -> dict[str, tuple[tuple[int, ...], str]]:
    return {v.name: (v.meta.shape, v.meta.dtype.name) for v in values
            if v.role.value in _STATE_ROLES}


_TOKEN = re.compile(r"S\((\d+)\)|P\((\w+)\)|P|R")


def parse_sbp(text: str) -> NdSbp:
    """`S(0)R` -> (Shard(0), Replicate()); the inverse of `sbp.fmt`."""
    out: list[Sbp] = []
    for m in _TOKEN.finditer(text):
        if m.group(1) is not None:
            out.append(Shard(int(m.group(1))))
        elif m.group(2) is not None:
            out.append(Partial(m.group(2)))
        elif m.group(0) == "P":
            out.append(Partial())
        else:
            out.append(Replicate())
    return tuple(out)


_FMT_MEMO: dict[NdSbp, str] = {}


def _fmt(sbp: NdSbp) -> str:
    """`sbp` as text (`S(0)R`), memoized: a Job has a handful of layouts."""
    out = _FMT_MEMO.get(sbp)
    if out is None:
        out = _FMT_MEMO[sbp] = fmt(sbp)
    return out


_SBP_MEMO: dict[str, NdSbp] = {}
_ROLES = {r.value: r for r in Role}


def _sbp(text: str) -> NdSbp:
    """`parse_sbp`, memoized: a Job has a handful of distinct layouts."""
    out = _SBP_MEMO.get(text)
    if out is None:
        if not isinstance(text, str):
            raise Malformed(f"expected a layout, got {text!r:.40}")
        out = _SBP_MEMO[text] = parse_sbp(text)
    return out


def _value_row(v: Value, sbp: NdSbp) -> list:
    return [v.id, list(v.meta.shape), v.meta.dtype.name, v.role.value, v.name, _fmt(sbp)]


def _value(row) -> tuple[Value, NdSbp]:
    vid, shape, dtype, role, name, sbp = row
    if type(vid) is not int or not isinstance(name, str) or \
            not all(type(s) is int for s in shape):
        raise Malformed(f"value {vid}: bad name or shape")
    return Value(vid, TensorMeta(tuple(shape), DType(dtype)), _ROLES[role], name), _sbp(sbp)


def _src_stage(row) -> int:
    return dict(row[4])["src_stage"]


def _pairs(rows) -> tuple:
    return tuple((a, b) for a, b in rows)


def _tuples(x):
    return tuple(_tuples(i) for i in x) if isinstance(x, list) else x


def _strategy(d: dict) -> Strategy:
    return Strategy(**{k: _tuples(v) for k, v in d.items()})


# Strategy fields added after Jobs were pinned: written only when not their
# default, so every earlier Job keeps its bytes (`Strategy(**d)` fills them in).
_LATER_FIELDS = {"ep": 1, "cp": 1, "cp_balance": True, "cp_attention": "auto",
                 "sequence_parallel": False}


def strategy_to_json(s: Strategy) -> dict:
    return {k: v for k, v in asdict(s).items() if _LATER_FIELDS.get(k, object()) != v}


def _encode(job: Job) -> Parts:
    g = job.graph
    head = {"mesh": asdict(job.mesh), "strategy": strategy_to_json(job.strategy),
            # update_values: no reader since views take the updates by name from the
            # "graph" part; kept, for the Job's bytes are pinned (tests/goldens)
            "loss": g.loss, "update_values": sorted({u.value for u in g.updates}),
            "layers": list(job.layers), "layer_stage": list(job.layer_stage),
            "layer_chunk": list(job.layer_chunk), "notes": list(job.notes),
            "temps": [list(t) for t in job.temps], "nops": len(g.ops)}
    stages: dict[int, list] = {}
    touched: dict[int, set] = {}  # stage -> the values its view reads
    transfers = []
    for op in g.ops:
        row = op_to_row(op) + [job.chunk[op.id], list(job.variant[op.id])]
        on = [job.stage[op.id]]
        if op.kind == TRANSFER:
            transfers.append(row + [job.stage[op.id]])
            on.append(op.int_kwarg("src_stage"))
        else:
            stages.setdefault(job.stage[op.id], []).append(row)
        for st in on:
            touched.setdefault(st, set()).update(v for v in op.refs() + op.outputs if v >= 0)
    rest = set(range(len(g.values))).difference(*touched.values())
    parts = {"head": encode_part(head)}
    # what only a whole decode needs (names of updates run long: 144 KB on GPT-3)
    parts["graph"] = encode_part({"inputs": list(g.inputs), "data": list(_data_ids(g)),
                                  "rank_wide": [_value_row(g.values[v], job.sbp[v])
                                                for v in _rank_wide(g)],
                                  "updates": [[u.name, u.value] for u in g.updates],
                                  "meta": facts_to_pairs(g.facts),
                                  "grads": [list(x) for x in g.grads],
                                  **({"reports": [list(x) for x in g.reports]}
                                     if g.reports else {})})
    for name, vids in [*((f"values/{st}", touched[st]) for st in sorted(touched)),
                       ("values/rest", rest)]:
        parts[name] = encode_part([_value_row(g.values[v], job.sbp[v]) for v in sorted(vids)])
    parts.update((f"ops/{st}", encode_part(stages[st])) for st in sorted(stages))
    parts["transfers"] = encode_part(transfers)
    return sealed_parts(KIND, VERSION, parts)


def _decode(parts: Parts, head: dict, mesh: Mesh, strategy: Strategy) -> Job:
    ops: list = [None] * head["nops"]
    rest = parts.load("graph")
    for name in parts.index:
        if name.startswith("ops/") or name == "transfers":
            fixed = None if name == "transfers" else int(name[4:])
            for row in parts.load(name):
                ops[row[0]] = (row, row[-1] if fixed is None else fixed)
    if any(o is None for o in ops):
        raise Malformed("an op id is missing")
    decoded: dict[int, tuple[Value, NdSbp]] = {}
    for name in parts.index:
        if name.startswith("values/"):
            decoded.update((r[0], _value(r)) for r in parts.load(name) if r[0] not in decoded)
    if sorted(decoded) != list(range(len(decoded))):
        raise Malformed("a value id is missing")
    values, sbp = zip(*(decoded[v] for v in range(len(decoded)))) if decoded else ((), ())
    graph = Graph(values=tuple(values), ops=tuple(op_from_row(r[:9]) for r, _ in ops),
                  inputs=tuple(rest["inputs"]), loss=head["loss"],
                  updates=tuple(Update(a, b) for a, b in rest["updates"]),
                  facts=facts_from_pairs(rest["meta"]), grads=_pairs(rest["grads"]),
                  reports=_pairs(rest.get("reports", ())))
    return Job(graph=graph, mesh=mesh, strategy=strategy,
               stage=tuple(st for _, st in ops), chunk=tuple(r[9] for r, _ in ops),
               sbp=tuple(sbp), variant=tuple(tuple(r[10]) for r, _ in ops),
               layers=tuple(head["layers"]), layer_stage=tuple(head["layer_stage"]),
               layer_chunk=tuple(head["layer_chunk"]), notes=tuple(head["notes"]),
               temps=_pairs(head["temps"]))


def check_job_well_formed(job: Job) -> None:
    """Assert the Job's placement invariants (internal errors only): every op
    reads values made on its own stage (or graph inputs), except a transfer,
    which reads on its source stage; annotations cover every op and value."""
    g = job.graph
    assert len(job.stage) == len(job.chunk) == len(job.variant) == len(g.ops)
    assert len(job.sbp) == len(g.values)
    made_on: dict[int, int] = {}
    for op in g.ops:
        here = job.stage[op.id]
        if op.kind == TRANSFER:
            here = op.int_kwarg("src_stage")
        for r in op.refs():
            src = made_on.get(r, here)
            assert src == here, (
                f"op {op.id} {op.kind} ({op.module_path}) on stage {here} reads value {r} "
                f"made on stage {src}")
        for o in op.outputs:
            if o >= 0:
                made_on[o] = job.stage[op.id]
