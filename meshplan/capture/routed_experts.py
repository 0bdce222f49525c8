"""transformers' expert blocks as one op: `meshplan.routed_experts`.

transformers 5's MoE models (Mixtral, Qwen-MoE, OLMoE) run their experts
as `grouped_mm_experts_forward`: sort the (token, choice) rows by expert,
gather the tokens' rows, count the rows per expert (`histc`, `cumsum`), a
grouped matmul in, the gated activation, a grouped matmul out, weigh by the
gates, restore the order, sum the k choices. Each of those ops alone works
on the whole batch's rows at once (a sort has no token shard), so the block
would run on every token on every rank; as one op it is token-wise, and
expert parallelism is its signature (`ops/routed_experts.py`).

Invariants:
- A block is fused only when its ops are exactly that form: the forward
  ops of one call of a module named `experts`, reading five values from
  outside (the tokens `(T, H)`, the choices `(T, k)` as integers, the gates
  `(T, k)`, two expert weights that are parameters), writing one value
  shaped and typed as the tokens; two grouped matmuls, the first reading
  the tokens' rows by the sorted choices, the second the activation of the
  first's gate half times its up half; and no op outside `_FORM` (a bias,
  a clamp, a post-expert norm, an expert-parallel sentinel mask: any other
  op leaves the block as it was, as ops).
- The fused op computes what the block did, in its order (see
  `ops/routed_experts.py`); capture's self-check runs it against the
  module's own forward on real weights.
"""

from __future__ import annotations

from meshplan.ir import Graph, GraphBuilder, Op, Phase, Ref, Role
from meshplan.ir.kinds import ROUTED_EXPERTS
from meshplan.ops.grads_nn import GROUPED_MM
from meshplan.ops.routed_experts import ACTIVATIONS

EXPERTS = "experts"
_VIEWS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"}
_SPLITS = {"aten.split.Tensor", "aten.chunk.default"}
_INDEX, _MUL, _SORT = "aten.index.Tensor", "aten.mul.Tensor", "aten.sort.default"
_FORM = _VIEWS | _SPLITS | set(ACTIVATIONS) | {
    _INDEX, _MUL, _SORT, GROUPED_MM, "aten.floor_divide.default", "aten._to_copy.default",
    "aten.histc.default", "aten.cumsum.default", "aten.transpose.int",
    "aten.unsqueeze.default", "aten.empty_like.default", "aten.arange.default",
    "aten.arange.start", "aten.index_put.default", "aten.sum.dim_IntList"}


def _block_of(path: str) -> str | None:
    """The path of the `experts` module `path` is in (itself or a child)."""
    parts = path.split(".")
    return ".".join(parts[:parts.index(EXPERTS) + 1]) if EXPERTS in parts else None


def _calls(graph: Graph) -> list[list[Op]]:
    """The forward ops of each call of an `experts` module: runs of
    consecutive ops under one such path."""
    runs: list[list[Op]] = []
    last = None
    for op in graph.ops:
        block = _block_of(op.module_path) if op.phase is Phase.FORWARD else None
        if block is not None and block == last:
            runs[-1].append(op)
        elif block is not None:
            runs.append([op])
        last = block
    return runs


def _fused(graph: Graph, ops: list[Op], readers: dict[int, list[int]]):
    """(args, kwargs, the block's output) of the fused op, or None where
    the block is not of the form (the module docstring)."""
    if any(op.kind not in _FORM for op in ops):
        return None
    mine = {o for op in ops for o in op.outputs}
    ids = {op.id for op in ops}
    made = {o: op for op in ops for o in op.outputs}
    outside = sorted({r for op in ops for r in op.refs() if r not in mine})
    out = [o for o in mine if o >= 0 and (o == graph.loss or any(
        c not in ids for c in readers.get(o, ())))]
    mms = [op for op in ops if op.kind == GROUPED_MM]
    if len(out) != 1 or len(outside) != 5 or len(mms) != 2:
        return None

    def source(v: int, kinds: set) -> tuple[int, int]:
        """Through ops of `kinds`: (the value reached, how many passed)."""
        n = 0
        while v in made and made[v].kind in kinds:
            v, n = made[v].refs()[0], n + 1
        return v, n

    w_in, flips_in = source(mms[0].refs()[1], {"aten.transpose.int"})
    w_out, flips_out = source(mms[1].refs()[1], {"aten.transpose.int"})
    params = {v.id for v in graph.inputs_by_role(Role.PARAM)}
    if {w_in, w_out} - params or flips_in != flips_out or flips_in > 1:
        return None
    rows = made.get(mms[0].refs()[0])
    act_mul = made.get(mms[1].refs()[0])
    if rows is None or rows.kind not in {_INDEX, "aten._to_copy.default"}:
        return None
    if rows.kind != _INDEX:
        rows = made.get(rows.refs()[0])
    if rows is None or rows.kind != _INDEX or act_mul is None or act_mul.kind != _MUL:
        return None
    x = rows.refs()[0]
    act = made.get(act_mul.refs()[0])
    split = made.get(act.refs()[0]) if act is not None else None
    if act is None or act.kind not in ACTIVATIONS or len(act.args) != 1 or act.kwargs or \
            split is None or split.kind not in _SPLITS or len(split.outputs) != 2 or \
            split.refs()[0] != mms[0].outputs[0] or act.refs()[0] != split.outputs[0] or \
            act_mul.refs()[1] != split.outputs[1]:
        return None
    (y,) = out
    rest = [v for v in outside if v not in (x, w_in, w_out)]
    metas = {v: graph.values[v].meta for v in (x, y, *rest)}
    if len(rest) != 2 or metas[y] != metas[x] or len(metas[x].shape) != 2:
        return None
    idx = next((v for v in rest if not metas[v].is_float), None)
    gates = next((v for v in rest if metas[v].is_float), None)
    if idx is None or gates is None or metas[idx].shape != metas[gates].shape or \
            metas[idx].shape[:1] != metas[x].shape[:1]:
        return None
    args = (Ref(x), Ref(idx), Ref(gates), Ref(w_in), Ref(w_out))
    return args, (("act", act.kind), ("transposed", flips_in == 0)), y


def fuse_routed_experts(graph: Graph) -> Graph:
    """`graph` with each transformers expert block of the form (the module
    docstring) replaced by one `routed_experts` op; itself if none is."""
    readers: dict[int, list[int]] = {}
    for op in graph.ops:
        for r in op.refs():
            readers.setdefault(r, []).append(op.id)
    fused = {}
    for ops in _calls(graph):
        found = _fused(graph, ops, readers)
        if found is not None:
            fused[ops[-1].id] = (found, {op.id for op in ops}, ops[-1])
    if not fused:
        return graph
    skip = set().union(*(ids for _, ids, _ in fused.values()))
    b = GraphBuilder(graph)
    b.ops = []
    new: dict[int, int] = {}  # a block's output -> the fused op's
    for op in graph.ops:
        if op.id in fused:
            (args, kwargs, y), _, last = fused[op.id]
            (out,) = b.add_op(ROUTED_EXPERTS, args, (graph.values[y].meta,), kwargs=kwargs,
                              module_path=_block_of(last.module_path) or "", source=last.source)
            new[y] = out
        elif op.id not in skip:
            args, kwargs = op.remap(lambda v: new.get(v, v))
            b.ops.append(op.renumbered(len(b.ops), -1, args, kwargs))
    b.reports = [(n, new.get(v, v)) for n, v in graph.reports]
    return b.build(new.get(graph.loss, graph.loss), graph.facts)
