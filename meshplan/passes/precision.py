"""Mixed precision: explicit casts around the ops that compute in bf16/fp16.

Runs on the forward Graph, before autodiff, so the gradients of the casts
come out of the ordinary rules (the gradient of a cast is the cast back)
and every later pass sees the casts as ops: SBP propagation lays them out,
boxing communicates the low-precision values (a row-parallel all-reduce
moves half the bytes), and the memory plan counts each low-precision copy
of a weight as the activation it is, next to the fp32 master weight.

The rules are torch.autocast's, as tables:
- LOW: matmul, linear, attention, convolution: every floating-point input
  is cast to the low dtype, so the op computes (and answers) in it;
- FP32: norms, softmax, losses and reductions: low-precision inputs are
  cast back to fp32;
- any other op runs in whatever its inputs promote to (a residual add of an
  fp32 stream and a bf16 branch is fp32).

Invariants: parameters, buffers and the optimizer state stay fp32 (master
weights); the loss is fp32; fp32 precision returns the graph unchanged.
One cast is made per (value, dtype) and shared by its readers.
"""

from __future__ import annotations

from meshplan.ir import DType, Graph, GraphBuilder, Phase, Ref, Update, verify
from meshplan.ops.emit import Emitter

DTYPES = {"bf16": DType("bfloat16"), "fp16": DType("float16")}
FP32 = DType("float32")
CAST = "aten._to_copy.default"

LOW = frozenset({
    "aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten.matmul.default", "aten.baddbmm.default", "aten.conv1d.default",
    "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default",
    "aten.scaled_dot_product_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
})
FP32_OPS = frozenset({
    "aten.native_layer_norm.default", "aten.layer_norm.default",
    "aten.group_norm.default", "aten.native_group_norm.default",
    "aten._native_batch_norm_legit_functional.default", "aten.batch_norm.default",
    "aten._softmax.default", "aten.softmax.int", "aten._log_softmax.default",
    "aten.log_softmax.int", "aten.nll_loss_forward.default", "aten.nll_loss.default",
    "aten.cross_entropy_loss.default", "aten.mse_loss.default",
    "aten.binary_cross_entropy_with_logits.default", "aten.sum.default",
    "aten.sum.dim_IntList", "aten.mean.default", "aten.mean.dim", "aten.logsumexp.default",
    "aten.cumsum.default", "aten.exp.default", "aten.log.default", "aten.pow.Tensor_Scalar",
    "aten.rsqrt.default", "aten.var.correction", "aten.var_mean.correction",
    "aten.norm.ScalarOpt_dim", "aten.linalg_vector_norm.default", "aten.cdist.default",
})


def apply_precision(graph: Graph, precision: str) -> Graph:
    """`graph` (a forward Graph) with casts for `precision` (fp32, bf16, fp16)."""
    if precision == "fp32":
        return graph
    assert all(op.phase is Phase.FORWARD for op in graph.ops), "runs before autodiff"
    low = DTYPES[precision]
    b = GraphBuilder()
    vmap: dict[int, int] = {}
    for vid in graph.inputs:
        v = graph.values[vid]
        vmap[vid] = b.add_input(v.meta, v.role, v.name)
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

    for op in graph.ops:
        e = Emitter(b, op.phase, op.module_path, op.source)
        want = low if op.kind in LOW else FP32 if op.kind in FP32_OPS else None
        args = tuple(arg(e, a, want) for a in op.args)
        kwargs = tuple((k, arg(e, v, want)) for k, v in op.kwargs)
        same = all(b.meta(vmap[r]) == graph.values[r].meta for r in op.refs()) and \
            not any(r in casts_of for r in _refs(args, kwargs))
        if same:  # no input changed dtype: the outputs are as captured
            outs = e.emit(op.kind, args, [graph.values[o].meta if o >= 0 else None
                                          for o in op.outputs], kwargs)
        else:
            outs = tuple(r.id for r in e.call_multi(op.kind, *args, **dict(kwargs)))
        for old, new in zip(op.outputs, outs):
            if old >= 0:
                vmap[old] = new
    loss = Ref(vmap[graph.loss])
    if b.meta(loss.id).dtype != FP32:
        loss = Emitter(b, Phase.FORWARD, graph.ops[-1].module_path).call(CAST, loss, dtype=FP32)
    b.updates = [Update(u.name, vmap[u.value]) for u in graph.updates]
    out = b.build(loss.id, graph.meta + (("precision", precision),))
    verify(out)
    return out


def _refs(args: tuple, kwargs: tuple) -> list[int]:
    out: list[int] = []
    for a in args + tuple(v for _, v in kwargs):
        if isinstance(a, Ref):
            out.append(a.id)
        elif isinstance(a, tuple):
            out += _refs(a, ())
    return out
