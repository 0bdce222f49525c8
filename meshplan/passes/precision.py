"""Mixed precision: explicit casts around the ops that compute in bf16/fp16.

Runs on the forward Graph, before autodiff, so the gradients of the casts
come out of the ordinary rules (the gradient of a cast is the cast back)
and every later pass sees the casts as ops: SBP propagation lays them out,
boxing communicates the low-precision values (a row-parallel all-reduce
moves half the bytes), and the memory layout counts each low-precision copy
of a weight as the activation it is, next to the fp32 master weight.

The rules are torch.autocast's, in the op rule table (`OpRule.precision`,
listed in `ops/policy.py`):
- `LOW`: matmul, linear, attention, convolution: every floating-point input
  is cast to the low dtype, so the op computes (and answers) in it;
- `FP32`: norms, softmax, losses and reductions: low-precision inputs are
  cast back to fp32;
- any other op runs in whatever its inputs promote to (a residual add of an
  fp32 stream and a bf16 branch is fp32).

A graph captured for this precision was traced under autocast
(`capture/model_casts.py`): it holds the model's own casts, resolved as
eager resolves them, and autocast's. There the pass adds the casts of its
lists that the capture's (CPU autocast's) lack: `FP32` ops' (norms, softmax),
`LOW_INSIDE` ops' (einsum), and a `LOW` op's whose input an `FP32` op made
fp32 again; it leaves a `LOW` op with no low input as it is: autocast was
off there (a router's `torch.autocast(enabled=False)`). A cast to the
dtype a value already has in this flow is dropped. A graph captured in
fp32 (the passes' own tests) gets every cast the lists name.

Invariants: parameters, buffers and the optimizer state stay fp32 (master
weights); the loss is fp32; fp32 precision returns the graph unchanged.
One cast is made per (value, dtype) and shared by its readers.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.ir import DType, Graph, Phase, Ref
from meshplan.ir.choices import OpPrecision, Precision
from meshplan.ir.graph import LOW_DTYPES, refs_in
from meshplan.ops.emit import Emitter
from meshplan.ops.table import rule_for
from meshplan.passes.rebuild import Rebuild

FP32 = DType("float32")
CAST = "aten._to_copy.default"

def apply_precision(graph: Graph, precision: Precision) -> Graph:
    """`graph` (a forward Graph) with casts for `precision` (fp32, bf16, fp16)."""
    if precision == Precision.FP32:
        return graph
    assert all(op.phase is Phase.FORWARD for op in graph.ops), "runs before autodiff"
    low = LOW_DTYPES[precision]
    rb = Rebuild(graph, fresh=True)  # every value made again: casts sit beside their readers
    b, vmap = rb.b, rb.vmap
    casts: dict[tuple[int, DType], Ref] = {}
    casts_of: set[int] = set()  # ids of cast outputs

    def cast(e: Emitter, r: Ref, want: DType) -> Ref:
        meta = b.meta(r.id)
        if not meta.is_float or meta.dtype == want:
            return r
        key = (r.id, want)
        if key not in casts:
            casts[key] = e.call(CAST, r, dtype=want)
            casts_of.add(casts[key].id)
        return casts[key]

    def arg(e: Emitter, a, want: DType | None):
        if isinstance(a, Ref):
            r = Ref(vmap[a.id])
            return r if want is None or (want == FP32 and b.meta(r.id).dtype != low) \
                else cast(e, r, want)
        if isinstance(a, tuple):
            return tuple(arg(e, x, want) for x in a)
        return a

    in_flow = graph.facts.captured_for == precision  # autocast's casts are ops already
    for op in graph.ops:
        e = rb.emitter(op)
        policy = rule_for(op.kind).precision
        if in_flow and policy is OpPrecision.LOW and \
                all(graph.values[r].meta.dtype != low for r in op.refs()):
            policy = OpPrecision.PROMOTE  # autocast was off here: the model's fp32
        want = low if policy in (OpPrecision.LOW, OpPrecision.LOW_INSIDE) \
            else FP32 if policy is OpPrecision.FP32 else None
        args = tuple(arg(e, a, want) for a in op.args)
        kwargs = tuple((k, arg(e, v, want)) for k, v in op.kwargs)
        if op.kind == CAST and len(kwargs) == 1 and kwargs[0][0] == "dtype" \
                and kwargs[0][1].torch.is_floating_point and b.meta(args[0].id).is_float:
            # the capture's own cast: shared as the pass's are, none where it changes nothing
            vmap[op.outputs[0]] = cast(e, args[0], kwargs[0][1]).id
            continue
        same = all(b.meta(vmap[r]) == graph.values[r].meta for r in op.refs()) and \
            not any(r in casts_of for r in refs_in(args, kwargs))
        if same:  # no input changed dtype: the outputs are as captured
            outs = e.emit(op.kind, args, [graph.values[o].meta if o >= 0 else None
                                          for o in op.outputs], kwargs)
        else:
            outs = tuple(r.id for r in e.call_multi(op.kind, *args, **dict(kwargs)))
        rb.replaced(op)
        for old, new in zip(op.outputs, outs):
            if old >= 0:
                vmap[old] = new
    loss = Ref(vmap[graph.loss])
    if b.meta(loss.id).dtype != FP32:
        loss = Emitter(b, Phase.FORWARD, graph.ops[-1].module_path).call(CAST, loss, dtype=FP32)
    return rb.build(graph, loss.id, replace(graph.facts, precision=precision))

