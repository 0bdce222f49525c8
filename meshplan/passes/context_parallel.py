"""Context parallelism: the sequence's order for load balance, and the
check that every attention computes on a split of the sequence's ranks.

Invariants:
- Load balance (`balance_sequence`, `Strategy.cp_balance`; with attention's
  all-gather form, which `auto` then is: the all-to-all form computes every
  position of its heads, balanced already): causal
  attention's work grows with a query's position, so a rank holding the
  sequence's last part would do most of it. The forward graph is made to
  compute on the sequence reordered so that the contiguous split over cp
  gives rank r chunks r and 2cp-1-r of 2cp (`zigzag`, torchtitan's and
  Megatron's head-and-tail split): every data input is reordered along
  the sequence once, each `arange` of the sequence's length (the
  positions) is the same order, and the causal mask of each rank's rows
  is taken at those positions (`CAUSAL_OFFSET`). Every other op is
  position-wise, and the loss a mean, so the step computes what the model
  does. A model whose forward reads a neighbour along a sequence-long dim
  (a slice, pad, roll or running sum there: transformers' label shift) is
  left in order, and the plan says so in a note; one without causal
  attention has nothing to balance.
- Nothing here chooses a layout. The inputs rest split by sequence over the
  cp axis (`propagate._input_layouts`), and propagation carries the split
  through every position-wise op; attention's rule (`ops/sbp_nn.py`)
  offers its queries split by sequence against whole keys and values (the
  boxing all-gathers them: Llama 3's form), or a head or batch split
  (DeepSpeed Ulysses' all-to-alls), or every tensor split by sequence with
  the keys and values passed around the cp ring inside the kernel (ring
  attention, `runtime/ring_attention.py`); `--cp-attention` names the form,
  or lets the cheaper of the first two be chosen (`propagate.CP_FORMS`).
- With the all-gather form a layer's keys and values are gathered whole
  for its forward and again for its backward (`gathered_keys`, boxing's
  regather), so between the two a rank keeps only its own rows.
- A model whose attention cannot compute on a split over cp (no
  `scaled_dot_product_attention` at all, or one whose queries arrive
  whole: an op before it with no split rule) gains nothing from cp: one
  ConfigError line naming the attention and the op that took the split
  whole.
"""

from __future__ import annotations

from meshplan.errors import ConfigError
from meshplan.ir import Graph, Phase, Ref, Role
from meshplan.ir.choices import KernelVariant
from meshplan.ir.graph import DEVICE
from meshplan.ir.sbp import Shard
from meshplan.ir.sequence_order import chunk_order
from meshplan.passes.rebuild import Rebuild

ATTENTION = ("aten._scaled_dot_product_flash_attention_for_cpu.default",
             "aten.scaled_dot_product_attention.default")
ARANGE = "aten.arange.default"
# ops that read a neighbour along a dim: reordered, they would read another token
_NEIGHBOURS = {"aten.slice.Tensor": 1, "aten.narrow.default": 1, "aten.roll.default": 2,
               "aten.cumsum.default": 1, "aten.pad.default": -1,
               "aten.constant_pad_nd.default": -1}


def balance_sequence(graph: Graph, cp: int) -> tuple[Graph | None, tuple[int, ...], str]:
    """`graph` (a forward) computing on the zigzag order (see the module
    docstring) and its reordered data inputs (which propagation keeps split
    by sequence over cp: hinted), or (None, (), why not) when it has nothing
    to balance or reads neighbouring positions; a sequence that 2cp does not
    divide is one ConfigError line."""
    seqs = {graph.values[v].meta.shape[1] for v in graph.inputs
            if graph.values[v].role is Role.DATA and len(graph.values[v].meta.shape) > 1}
    causal = [op for op in graph.ops if op.kind == ATTENTION[0] and len(op.args) > 4
              and op.args[4] is True]
    masked = any(op.kind == ATTENTION[1] for op in graph.ops)
    if len(seqs) != 1 or not (causal or masked):
        return None, (), ""
    seq = seqs.pop()
    for op in graph.ops:
        reads = _neighbour_dim(graph, op, seq)
        if reads is not None:
            return None, (), (
                f"cp: the sequence is split in order, not load-balanced: {op.kind} in "
                f"{op.module_path or 'the model'} reads neighbouring positions (dim {reads}); "
                "causal attention's work then grows from the first cp rank to the last")
    if not causal:
        return None, (), ("cp: the sequence is split in order: attention takes the model's own "
                          "mask, whose causality is not read")
    if seq % (2 * cp):
        ok = [d for d in range(1, seq // 2 + 1) if seq % (2 * d) == 0 and d > 1]
        raise ConfigError(f"--cp {cp}: load balance splits the sequence into 2 x cp = {2 * cp} "
                          f"chunks, which do not divide its {seq} tokens; choose --cp among "
                          f"{', '.join(map(str, ok)) or '(none)'}, or pass --no-cp-balance")
    rb = Rebuild(graph)
    order, data = None, []
    for op in graph.ops:
        if order is None:  # the order, and every data input reordered, before the first op
            e = rb.emitter(op)
            c = seq // (2 * cp)
            parts = [e.call("aten.arange.start", k * c, (k + 1) * c, device=DEVICE)
                     for k in chunk_order(cp)]
            order = e.call("aten.cat.default", tuple(parts))
            for v in graph.inputs:
                meta = graph.values[v].meta
                if graph.values[v].role is Role.DATA and len(meta.shape) > 1:
                    rb.vmap[v] = e.call("aten.index_select.default", Ref(v), 1, order).id
                    data.append(rb.vmap[v])
        if op.kind == ARANGE and op.args in ((seq,), (0, seq)):
            rb.vmap[op.outputs[0]] = order.id  # the positions, in the same order
            continue
        rb.keep(op, [rb.vmap.get(r, r) for r in op.refs()])
    return rb.build(graph), tuple(data), ""


def _neighbour_dim(graph: Graph, op, seq: int) -> int | None:
    """The dim of size `seq` along which `op` reads a neighbour, if any."""
    pos = _NEIGHBOURS.get(op.kind)
    if pos is None or op.phase is not Phase.FORWARD:
        return None
    shape = graph.values[op.refs()[0]].meta.shape
    if pos < 0:  # pad: every padded dim, from the last
        pads = op.args[1]
        dims = [len(shape) - 1 - i // 2 for i in range(len(pads)) if pads[i]]
    else:
        dims = [op.args[pos] if len(op.args) > pos else dict(op.kwargs).get("dim", 0)]
    for d in dims:
        d = d % len(shape) if isinstance(d, int) and shape else d
        if isinstance(d, int) and shape and shape[d] == seq:
            return d
    return None


def check_attention_split(graph: Graph, sigs: dict, cp_axis: int, cp: int,
                          balanced: bool = False, ring: bool = False) -> None:
    """One ConfigError line unless the graph has attention and each one's
    queries are split over the cp axis (`sigs`: op id -> a signature per
    axis); with the sequence `balanced`, every causal kernel (forward and
    backward) takes its mask at its rows' positions (asserted: the all-gather
    form or the ring is the one propagation may choose then); the `ring`
    passes equal blocks, so cp must divide the sequence (one line)."""
    if balanced:
        for op in graph.ops:
            at = 7 if len(op.outputs) == 3 else 4  # is_causal, backward or forward
            if op.kind.startswith(ATTENTION[0][:-len(".default")]) and \
                    len(op.args) > at and op.args[at] is True:
                assert sigs[op.id][cp_axis].variant in (KernelVariant.CAUSAL_OFFSET,
                                                        KernelVariant.RING), op
    ops = [op for op in graph.ops if op.kind in ATTENTION and op.phase is Phase.FORWARD]
    if not ops:
        raise ConfigError(f"--cp {cp}: the model has no scaled_dot_product_attention to split "
                          "by sequence (context parallelism splits attention's queries; an "
                          "attention with dropout runs as its math ops: set its dropout to 0); "
                          "use --cp 1")
    for op in ops:
        seq = graph.values[op.refs()[0]].meta.shape[-2]
        if ring and seq % cp:
            raise ConfigError(f"--cp-attention ring: --cp {cp} does not divide the sequence's "
                              f"{seq} tokens, and the ring passes equal blocks; choose --cp "
                              "dividing it, or --cp-attention allgather")
        if not isinstance(sigs[op.id][cp_axis].ins[0], Shard):
            where = op.module_path or "the model"
            if seq % cp:
                ok = [d for d in range(2, seq + 1) if seq % d == 0]
                raise ConfigError(f"--cp {cp} does not divide the sequence's {seq} tokens, so "
                                  f"the attention in {where} would run whole on every cp rank; "
                                  f"choose --cp among {', '.join(map(str, ok[:8]))}")
            raise ConfigError(f"--cp {cp}: the attention {op.kind} in {where} gets its queries "
                              f"whole{_whole_at(graph, sigs, cp_axis, op)}, so it cannot "
                              "compute on a split of the sequence; use --cp 1")


def _whole_at(graph: Graph, sigs: dict, axis: int, attention) -> str:
    """Where the queries of `attention` became whole: the op nearest before
    it, on their way back, that takes a split input whole (its rule has no
    split for it), as a clause for the error line; "" if none."""
    made = {o: (op, i) for op in graph.ops if op.id in sigs for i, o in enumerate(op.outputs)}
    todo, seen = [attention.refs()[0]], set()
    while todo:
        v = todo.pop(0)
        if v in seen or v not in made:
            continue
        seen.add(v)
        op, _ = made[v]
        for r, need in zip(op.refs(), sigs[op.id][axis].ins):
            prev = made.get(r)
            if prev and isinstance(sigs[prev[0].id][axis].outs[prev[1]], Shard) and \
                    not isinstance(need, Shard):
                return f" ({op.kind} in {op.module_path or 'the model'} runs whole)"
            todo.append(r)
    return ""


def ring_note(graph: Graph, sigs: dict, cp_axis: int) -> tuple[str, ...]:
    """With `--cp-attention ring`, a note naming the attentions that compute
    another form (one taking the model's own mask has no ring kernel)."""
    other = sorted({op.module_path or "the model" for op in graph.ops
                    if op.kind in ATTENTION and op.phase is Phase.FORWARD
                    and sigs[op.id][cp_axis].variant != KernelVariant.RING})
    if not other:
        return ()
    return (f"cp: ring attention for the flash attentions; {len(other)} taking the model's own "
            f"mask ({other[0]}{', ...' if len(other) > 1 else ''}) take the cheaper of the "
            "all-gather and all-to-all forms instead (no ring kernel takes a mask)",)


def gathered_keys(graph: Graph) -> frozenset[int]:
    """Every forward attention's keys and values: with cp, gathered again
    for the backward rather than kept whole from the forward (as sequence
    parallelism's colwise inputs are), so a rank keeps only its rows."""
    return frozenset(r for op in graph.ops if op.kind in ATTENTION
                     and op.phase is Phase.FORWARD for r in op.refs()[1:3])
