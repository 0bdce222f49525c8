"""Pipeline partition with automatic PP -> VPP: every op gets a stage and a chunk.

Invariants (of `assign_stages`' result, for a train-step Graph):
- Layers are the forward ops whose module path `re.match`es the layer
  pattern; a layer instance is the match text (`blocks.3` for
  `blocks.3.attn.qkv` under `blocks\\.(\\d+)`), and its forward ops are
  contiguous (ops matching no layer may sit among them).
- Forward ops that match no layer belong to the preceding layer; those
  before the first layer belong to the first one.
- By default the L layers form `pp * vpp` equal segments in model order and
  segment `i` is virtual stage `i`, run where the schedule's stage placement
  (`schedules.stage_placement`) puts it: interleaved (Megatron), stage
  `i % pp`, chunk `i // pp`; the V of zbv, stage `i` then `2pp-1-i`:

      L = 8, pp = 2, vpp = 2        segment:  0     1     2     3
      layers 0-1 2-3 4-5 6-7        stage:    0     1     0     1   (V: 0 1 1 0)
                                    chunk:    0     0     1     1

- An uneven layout `stage_layers` (layers per virtual stage, in
  virtual-stage order) cuts the layers into segments of those lengths,
  then placed as above; each is >= 1 and they sum to L.
- A user layout (`layer_stages`) is used as given when it is non-decreasing
  and vpp == 1, replaced by the default when it is non-decreasing and
  vpp > 1, and kept with chunks assigned by runs when it is not monotone.
- A backward op sits with its forward op (`grad_of`); a `meshplan.grad_sum`
  with the last op (highest id) producing one of its inputs; gradient
  accumulation and optimizer ops with their parameter, i.e. with the first
  forward op that reads it. Any other op (the loss-gradient seed) sits with
  the last producer of its inputs, or else with its first consumer.
- A parameter read on several stages (a tied weight) is placed here as if
  it lived with its first reader; `passes/shared.py` then gives every
  reading stage its own accumulation and update. Graph inputs are not ops
  and get no entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshplan.errors import ConfigError
from meshplan.ir import Graph, Op, Phase, Ref, Role
from meshplan.ir.kinds import ACCUMULATE_GRAD, GRAD_SUM
from meshplan.ir.mesh import BALANCED
from meshplan.ir.stage_placement import StagePlacement
from meshplan.ir.state_name import StateName

MAX_EXAMPLES = 5       # module paths shown when the layer pattern matches nothing

Place = tuple[int, int]  # (stage, chunk)


@dataclass(frozen=True, slots=True)
class StageAssignment:
    """Stage and chunk (virtual stage) of every op, indexed by op id."""

    stage: tuple[int, ...]
    chunk: tuple[int, ...]
    layers: tuple[str, ...]       # layer instances in model order ("blocks.0", ...)
    layer_stage: tuple[int, ...]
    layer_chunk: tuple[int, ...]
    notes: tuple[str, ...] = ()   # remarks for the report

    def num_chunks(self) -> int:
        """Chunks on the stage that has the most (vpp for the default layout)."""
        return max(self.layer_chunk, default=0) + 1


def assign_stages(graph: Graph, pp: int, vpp: int, layer_pattern: str,
                  layer_stages: tuple[int, ...] = (),
                  placement: StagePlacement | None = None,
                  stage_layers: tuple[int, ...] | str = ()) -> StageAssignment:
    """Place every op of the train step `graph` on a (stage, chunk); the
    default layout follows `placement` (interleaved when None).

    Raises `ConfigError` for a pattern that matches nothing, a layer whose
    ops are not contiguous, a layer count that does not split into
    `pp * vpp` segments, or a bad `layer_stages`.
    """
    if pp < 1 or vpp < 1:
        raise ConfigError(f"pp={pp} and vpp={vpp} must both be >= 1; pass --pp and --vpp >= 1")
    layers, op_layer = find_layers(graph, layer_pattern)
    where = placement or StagePlacement.interleaved(pp, vpp)
    assert not isinstance(stage_layers, str), "stage_layers 'balanced' is resolved before this pass"
    if stage_layers:
        if layer_stages:
            raise ConfigError("layer_stages and stage_layers both give the layout; pass one "
                              "(--layer-stages takes either form)")
        stages, chunks = _by_counts(len(layers), where, tuple(stage_layers))
        notes: list[str] = []
    else:
        stages, chunks, notes = _layout(len(layers), where, tuple(layer_stages), layer_pattern)
    places = _Placer(graph, op_layer, list(zip(stages, chunks))).run()
    return StageAssignment(
        stage=tuple(p[0] for p in places), chunk=tuple(p[1] for p in places),
        layers=tuple(layers), layer_stage=tuple(stages), layer_chunk=tuple(chunks),
        notes=tuple(notes),
    )


# ---------------------------------------------------------------- layers


def find_layers(graph: Graph, layer_pattern: str) -> tuple[list[str], dict[int, int]]:
    """Layer instances in model order, and the layer index of each forward op."""
    rx = _compile(layer_pattern)
    names: dict[str, str | None] = {}  # module path -> layer instance (cache)
    layers: list[str] = []
    index: dict[str, int] = {}
    ends: dict[int, tuple[int, Op]] = {}  # layer -> (its last op id, next layer's first op)
    op_layer: dict[int, int] = {}
    current = last = 0
    for op in graph.ops:
        if op.phase is not Phase.FORWARD:
            continue
        path = op.module_path
        name = names[path] if path in names else names.setdefault(path, _instance(rx, path))
        if name is not None:
            if not layers or name != layers[current]:
                if name in index:
                    _not_contiguous(name, ends[index[name]], op)
                if layers:
                    ends[current] = (last, op)
                current = index[name] = len(layers)
                layers.append(name)
            last = op.id
        op_layer[op.id] = current
    if not layers:
        _no_layers(graph, layer_pattern)
    return layers, op_layer


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ConfigError(f"layer pattern '{pattern}' is not a valid regular expression "
                          f"({err}); fix --layer-pattern, e.g. 'blocks\\.\\d+'") from err


def _instance(rx: re.Pattern[str], path: str) -> str | None:
    m = rx.match(path)
    # An empty match names no layer (a pattern like '' or '.*?' would
    # otherwise make one nameless layer of the whole model).
    return m.group(0) if m and m.group(0) else None


class NotContiguous(ConfigError):
    """A layer whose ops another layer's interrupt (a layer called twice)."""


def _not_contiguous(name: str, end: tuple[int, Op], op: Op):
    last, mid = end
    raise NotContiguous(
        f"layer '{name}' is not contiguous in the forward pass: its ops stop at op #{last}, "
        f"op #{mid.id} {mid.kind} ('{mid.module_path}') runs in between, and '{name}' "
        f"resumes at op #{op.id} {op.kind} ('{op.module_path}'); call each layer once, "
        f"or change --layer-pattern so that one match is one contiguous layer")


def _no_layers(graph: Graph, pattern: str):
    paths = dict.fromkeys(op.module_path for op in graph.ops
                          if op.phase is Phase.FORWARD and op.module_path)
    examples = ", ".join(repr(p) for p in list(paths)[:MAX_EXAMPLES]) or "none"
    raise ConfigError(
        f"layer pattern '{pattern}' matches no forward op's module path (re.match from "
        f"the start; module paths include {examples}); pass --layer-pattern with a regex "
        f"whose match names one layer instance, e.g. 'blocks\\.\\d+'")


# ---------------------------------------------------------------- layout


def _layout(n: int, where: StagePlacement, user: tuple[int, ...], pattern: str):
    """(stage per layer, chunk per layer, notes)."""
    pp, vpp = where.pp, where.vpp
    if not user:
        _check_divisible(n, pp, vpp, pattern)
        return (*_by_placement(n, where), [])
    _check_user(user, n, pp)
    if any(a > b for a, b in zip(user, user[1:])):
        return _chunks_by_runs(user, pp, vpp)
    if vpp == 1:
        _check_every_stage(user, pp)
        return list(user), [0] * n, []
    _check_divisible(n, pp, vpp, pattern)
    note = (f"layer_stages {list(user)} is non-decreasing and vpp={vpp} > 1, so it is "
            f"replaced by the schedule's layout: segment i of {pp * vpp} is virtual stage i "
            f"(stages {list(where.ranks)}, by virtual stage)")
    return (*_by_placement(n, where), [note])


def _by_placement(n: int, where: StagePlacement) -> tuple[list[int], list[int]]:
    return _segments([n // where.num_stages] * where.num_stages, where)


def _segments(counts, where: StagePlacement) -> tuple[list[int], list[int]]:
    segs = [v for v, k in enumerate(counts) for _ in range(k)]
    return [where.rank_of(s) for s in segs], [where.chunk_of(s) for s in segs]


def _by_counts(n: int, where: StagePlacement, counts: tuple[int, ...]):
    """Layers per virtual stage, given; checked."""
    if len(counts) != where.num_stages or sum(counts) != n or min(counts) < 1:
        raise ConfigError(f"stage_layers {list(counts)} must give each of the pp*vpp = "
                          f"{where.num_stages} virtual stages at least one layer and sum to the "
                          f"model's {n} layers; e.g. {_example(n, where.num_stages)}")
    return _segments(counts, where)


def _example(n: int, k: int) -> str:
    if n < k:
        return f"lower pp*vpp to at most {n}"
    return ",".join(str(n // k + (1 if i < n % k else 0)) for i in range(k))


def _check_divisible(n: int, pp: int, vpp: int, pattern: str) -> None:
    if n % (pp * vpp) == 0:
        return
    what = (f"{n} layers (matches of '{pattern}') do not split into pp*vpp = "
            f"{pp}*{vpp} = {pp * vpp} equal segments")
    uneven = f", or pass --stage-layers {BALANCED} for unequal ones" if n >= pp * vpp else ""
    if n % pp:
        valid = [p for p in range(1, n + 1) if n % p == 0]
        raise ConfigError(f"{what}; pp must divide the layer count: "
                          f"valid pp values: {', '.join(map(str, valid))}{uneven}")
    valid = [v for v in range(1, n // pp + 1) if n % (pp * v) == 0]
    raise ConfigError(f"{what}; pass a --vpp that divides {n // pp}: "
                      f"valid vpp values: {', '.join(map(str, valid))}{uneven}")


def _check_user(user: tuple[int, ...], n: int, pp: int) -> None:
    if len(user) != n:
        raise ConfigError(f"layer_stages has {len(user)} entries but the model has {n} "
                          f"layers; give exactly {n} stage ids, one per layer in model order")
    bad = [(i, s) for i, s in enumerate(user) if not isinstance(s, int) or not 0 <= s < pp]
    if bad:
        i, s = bad[0]
        raise ConfigError(f"layer_stages[{i}] = {s!r} is outside [0, {pp}) for pp={pp}; "
                          f"use stage ids 0 .. {pp - 1}")


def _check_every_stage(user: tuple[int, ...], pp: int) -> None:
    empty = sorted(set(range(pp)) - set(user))
    if empty:
        raise ConfigError(f"layer_stages {list(user)} gives no layer to stage(s) "
                          f"{', '.join(map(str, empty))} of pp={pp}; give every stage "
                          f"at least one layer, or lower --pp")


def _chunks_by_runs(user: tuple[int, ...], pp: int, vpp: int):
    """Keep a non-monotone layout; the k-th run of layers on a stage is chunk k."""
    _check_every_stage(user, pp)
    runs = [0] * pp
    chunks = []
    for i, s in enumerate(user):
        if i == 0 or user[i - 1] != s:
            runs[s] += 1
        chunks.append(runs[s] - 1)
    counts = ", ".join(f"stage {s}: {c}" for s, c in enumerate(runs))
    note = (f"layer_stages {list(user)} is not monotone (non-decreasing), so it is kept "
            f"as given with chunks assigned by runs; chunks per stage: {counts}")
    if any(c != vpp for c in runs):
        note += f"; vpp={vpp} is not used"
    return list(user), chunks, [note]


# ---------------------------------------------------------------- ops


class _Placer:
    """One pass over the ops in order; producers are placed before consumers."""

    __slots__ = ("graph", "op_layer", "layer_place", "place", "producer",
                 "params", "by_name", "reader")

    def __init__(self, graph: Graph, op_layer: dict[int, int], layer_place: list[Place]):
        self.graph = graph
        self.op_layer = op_layer
        self.layer_place = layer_place
        self.place: list[Place | None] = [None] * len(graph.ops)
        self.producer = [-1] * len(graph.values)  # value id -> op id
        params = graph.inputs_by_role(Role.PARAM)
        self.params = {v.id for v in params}
        self.by_name = {v.name: v.id for v in params}
        self.reader: dict[int, int] = {}  # param id -> first forward op reading it

    def run(self) -> list[Place]:
        place, producer = self.place, self.producer
        for op in self.graph.ops:
            place[op.id] = _rule_of(op)(self, op)
            for o in op.outputs:
                if o >= 0:
                    producer[o] = op.id
        if None in place:
            self._place_by_consumer()
        return place  # type: ignore[return-value]

    def by_layer(self, op: Op) -> Place:
        p = self.layer_place[self.op_layer[op.id]]
        for r in op.refs():
            if r in self.params:
                self.reader.setdefault(r, op.id)
        return p

    def by_forward_op(self, op: Op) -> Place | None:
        # No `op.refs()` here: most ops take this rule, and refs() is the pass's
        # main cost (measured on GPT-3 175B: 29 ms with refs() on every op, 11 ms as is).
        return self.place[op.grad_of]

    def by_param(self, op: Op) -> Place | None:
        # The parameter (optimizer) or its accumulator (accumulate) is a
        # top-level argument; scanning `op.args` beats `op.refs()` here.
        for a in op.args:
            if not isinstance(a, Ref):
                continue
            v = self.graph.values[a.id]
            pid = a.id if v.role is Role.PARAM else \
                self.by_name.get(StateName.parse(v.name).fqn) if v.role is Role.GRAD \
                else None
            if pid is not None and pid in self.reader:
                return self.place[self.reader[pid]]
        return self.by_last_producer(op)

    def by_last_producer(self, op: Op) -> Place | None:
        last = max((self.producer[r] for r in op.refs()), default=-1)
        return self.place[last] if last >= 0 else None  # None: placed by consumer

    def _place_by_consumer(self) -> None:
        # Ops without a placed producer (factories such as `aten.arange` outside
        # the forward) go with their first consumer; later ones resolve first.
        consumers = self.graph.consumers()
        for i in reversed(range(len(self.place))):
            if self.place[i] is None:
                users = [c.id for o in self.graph.ops[i].outputs for c in consumers.get(o, ())]
                p = self.place[min(users)] if users else None
                self.place[i] = p if p is not None else self.layer_place[0]


_KIND_RULES = {GRAD_SUM: _Placer.by_last_producer, ACCUMULATE_GRAD: _Placer.by_param}


def _rule_of(op: Op):
    """The placement rule of one op: by phase, then kind, then a default."""
    if op.phase is Phase.FORWARD:
        return _Placer.by_layer
    rule = _KIND_RULES.get(op.kind)
    if rule is not None:
        return rule
    if op.phase is Phase.OPTIMIZER:
        return _Placer.by_param
    if op.grad_of >= 0:
        return _Placer.by_forward_op
    return _Placer.by_last_producer
