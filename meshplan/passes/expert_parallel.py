"""Expert parallelism's parameters: which weights are experts, split over ep.

Invariants:
- An expert parameter is one held directly by a module named `experts`
  (`...experts.w1`, transformers' `...mlp.experts.gate_up_proj`) whose dim 0
  counts the experts: all the experts of a block as one tensor, as the
  zoo's MoE and transformers 5's fused experts hold them (and as a grouped
  matmul reads them). A list of per-expert modules (`experts.0.w1`) is not.
- The experts of every such module number the same, and ep divides them,
  so every rank of an ep group holds E / ep whole experts (Megatron's rule).
- Each MoE block's load is a report of the graph (`expert_load`),
  `tokens_per_expert/<block>`: its router's choices (the indices of its
  top-k over the experts, the first such op in the block) counted per
  expert, summed over the batch, as torchtitan counts them (before any
  capacity drops a choice).
- Only the parameters are chosen here; the layouts follow by propagation:
  each expert weight is Shard(0) on the ep axis, and the tokens reach their
  experts by the all-to-alls the boxing derives (the zoo's MoE) or inside
  a routed experts op (transformers' blocks, fused at capture:
  `ops/routed_experts.py`). Where an op cannot compute on an expert shard
  (a grouped matmul left unfused, whose token split per expert is
  data-dependent), the boxing gathers the weight whole over ep before it:
  still exact, but not expert-parallel; `gathered_note` says so.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.errors import ConfigError
from meshplan.ir import Graph, Phase, Ref, Role, Value
from meshplan.ir.kinds import ALL_GATHER
from meshplan.passes.rebuild import Rebuild

EXPERTS_MODULE = "experts"
LOAD = "tokens_per_expert/"  # a report's name: LOAD + the MoE block's module path
TOPK = "aten.topk.default"


def is_expert_param(name: str) -> bool:
    """`name` is a weight held directly by a module named `experts`."""
    module, _, _ = name.rpartition(".")
    return module.rpartition(".")[2] == EXPERTS_MODULE


def expert_weights(graph: Graph) -> list[Value]:
    """The graph's expert parameters (under any of a tied weight's names)."""
    return [v for v in graph.inputs_by_role(Role.PARAM)
            if v.meta.shape and any(is_expert_param(n) for n in graph.names_of(v.name))]


def expert_params(graph: Graph, ep: int) -> frozenset[int]:
    """The ids of the expert parameters (see the module docstring); a model
    without any, or whose experts ep does not divide, is one ConfigError."""
    found = {v.id: v for v in expert_weights(graph)}
    if not found:
        raise ConfigError(f"--ep {ep}: the model has no expert weights (parameters of a "
                          f"module named '{EXPERTS_MODULE}' holding every expert as one "
                          "tensor, experts on dim 0, as transformers' MoE models and "
                          "--model moe do); use --ep 1")
    counts = {v.meta.shape[0] for v in found.values()}
    if len(counts) > 1:
        names = sorted(v.name for v in found.values())
        raise ConfigError(f"--ep {ep}: the expert weights hold different numbers of experts "
                          f"({', '.join(map(str, sorted(counts)))}; e.g. {names[0]}); "
                          "expert parallelism needs one count; use --ep 1")
    check_ep_divides(counts.pop(), ep)
    return frozenset(found)


def check_ep_divides(experts: int, ep: int) -> None:
    """One ConfigError line when `ep` does not divide the `experts`."""
    if experts % ep:
        ok = [d for d in range(2, experts + 1) if experts % d == 0]
        raise ConfigError(f"--ep {ep} does not divide the model's {experts} experts; choose "
                          f"--ep among {', '.join(map(str, ok)) or '1'}")


def gathered_note(graph: Graph, experts: frozenset, ep_axis: int | None) -> tuple[str, ...]:
    """A note naming the ops that read expert weights gathered whole over
    ep (none: the experts compute where they rest)."""
    derived, gathered = set(experts), set()  # derived: a weight's views (a transpose)
    for op in graph.ops:
        if op.kind == ALL_GATHER and op.refs()[0] in derived and \
                dict(op.kwargs).get("axis") == ep_axis:
            gathered.add(op.outputs[0])
        elif len(op.refs()) == 1 and op.refs()[0] in derived:
            derived.update(o for o in op.outputs if o >= 0)
    readers = sorted({op.kind for op in graph.ops if set(op.refs()) & gathered})
    if not readers:
        return ()
    return (f"ep: the expert weights are gathered whole over ep before "
            f"{', '.join(readers)}, which cannot compute on a shard of the experts (its "
            "tokens per expert are data-dependent); exact, and the weights and their "
            "optimizer state rest split over ep, but the experts' compute is not "
            "expert-parallel",)


def moe_blocks(graph: Graph) -> dict[str, int]:
    """Each MoE block's module path (the parent of an `experts` module) and
    its number of experts."""
    return {v.name.rpartition(".")[0].rpartition(".")[0]: v.meta.shape[0]
            for v in expert_weights(graph)}


def expert_load(graph: Graph) -> Graph:
    """`graph` with each MoE block's router choices counted per expert, a
    report `tokens_per_expert/<block>` (see the module docstring): a
    one-hot of the choices, summed over every dim but the experts'."""
    blocks = moe_blocks(graph)
    routers = {}
    for op in graph.ops:
        if op.kind != TOPK or op.phase is not Phase.FORWARD:
            continue
        block = next((b for b in blocks if op.module_path == b
                      or op.module_path.startswith(b + ".")), None)
        if block is not None and block not in routers and \
                graph.values[op.refs()[0]].meta.shape[-1] == blocks[block]:
            routers[block] = op.id
    if not routers:
        return graph
    rb, reports, at = Rebuild(graph), [], {i: b for b, i in routers.items()}
    for op in graph.ops:
        rb.keep(op)
        block = at.get(op.id)
        if block is not None:
            e = rb.emitter(op)
            hot = e.call("aten.one_hot.default", Ref(op.outputs[1]), blocks[block])
            dims = tuple(range(len(rb.b.meta(hot.id).shape) - 1))
            reports.append((LOAD + block, e.call("aten.sum.dim_IntList", hot, dims).id))
    out = rb.build(graph)
    return replace(out, reports=out.reports + tuple(reports))
