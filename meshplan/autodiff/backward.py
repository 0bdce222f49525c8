"""autodiff: forward Graph -> train-step Graph (forward, backward, optimizer).

Invariants:
- Backward ops are emitted in reverse forward order by each op's rule
  (`OpRule.grad`); each has phase=backward, its forward op's module path and
  `grad_of` = that forward op's id.
- A value with several gradient contributions gets one `meshplan.grad_sum`.
- The loss gradient is seeded with 1/num_microbatches, so accumulating the
  micro-batch gradients gives the gradient of the mean loss. The seed is a
  constant (`aten.full`), not `full_like(loss)`: no op of the step reads the
  loss, so its reduction over dp can finish in the background; with
  `loss_scale` (fp16) the seed is also multiplied by the state
  `amp@loss_scale`, which the executor divides out before the optimizer.
- Each parameter's gradient is added into its accumulator (`<fqn>@grad`,
  phase=backward) every micro-batch, right after the op that completes it
  (so no weight gradient outlives its layer's backward); the optimizer ops
  (phase=optimizer) read the accumulator once per step.
- With `max_grad_norm`, every optimizer op takes one more input, the
  clipping factor (kwarg `coef`), made from the squared norms of all gradients
  (`_emit_clip`). With a learning-rate schedule its `lr` is the state LR
  (ir/lr_schedule.py); a parameter `no_decay` names takes weight decay 0.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.autodiff.optimizer import SLOTS, OptimizerConfig, slot_meta_shape
from meshplan.errors import CaptureError
from meshplan.ir import (
    DEVICE,
    GRAD_NORM,
    LOSS_SCALE,
    LR,
    STEP_COUNT,
    DType,
    Graph,
    GraphBuilder,
    Op,
    Phase,
    Ref,
    Role,
    TensorMeta,
    Update,
    check_well_formed,
)
from meshplan.ir.builder import renumber_ops
from meshplan.ir.graph_facts import TrainFacts
from meshplan.ir.kinds import (
    ACCUMULATE_GRAD,
    CLIP_COEF,
    GRAD_SQ,
    GRAD_SUM,
    SQ_SUM,
    optimizer_kind,
)
from meshplan.ir.state_name import StateName
from meshplan.ops.emit import Emitter
from meshplan.ops.table import rule_for


def build_train_step(
    graph: Graph, optimizer: OptimizerConfig | None = None, num_microbatches: int = 1,
    loss_scale: float | None = None,
) -> Graph:
    """Append backward, gradient accumulation and optimizer ops to `graph`."""
    optimizer = optimizer or OptimizerConfig()
    b = GraphBuilder(graph)
    needs = _requires_grad(graph)
    scale = b.add_input(TensorMeta((), DType("float32")), Role.OPT_STATE, LOSS_SCALE) \
        if loss_scale is not None else None
    param_grads = _emit_backward(b, graph, needs, num_microbatches, scale)
    accs = _emit_accumulate(b, graph, param_grads)
    _emit_optimizer(b, graph, accs, optimizer)
    train = TrainFacts(
        optimizer.kind, num_microbatches, optimizer, optimizer.guard,
        (optimizer.lr_schedule.resolved(optimizer.lr), optimizer.lr)
        if optimizer.lr_schedule.scheduled else None,
        None if loss_scale is None else float(loss_scale))
    b.ops = list(_accumulate_early(b.ops))
    step = b.build(graph.loss, replace(graph.facts, train=train))
    check_well_formed(step)
    return step


def _accumulate_early(ops: list[Op]) -> tuple[Op, ...]:
    """`ops` with each gradient accumulation moved up to just after the op
    that produces its gradient (ids renumbered, order otherwise kept)."""
    made_by = {o: op.id for op in ops for o in op.outputs}
    after: dict[int, list[Op]] = {}
    rest = []
    for op in ops:
        if op.kind == ACCUMULATE_GRAD:
            after.setdefault(made_by[op.args[1].id], []).append(op)
        else:
            rest.append(op)
    ordered = []
    for op in rest:
        ordered.append(op)
        ordered += after.pop(op.id, [])
    assert not after
    return renumber_ops(ordered)


def _requires_grad(graph: Graph) -> set[int]:
    """Values that depend on a float parameter through differentiable ops,
    float or complex (an FFT's complex output left out cut the gradient of
    everything before it: transformers' FNet trained wrong, silently)."""
    need = {v.id for v in graph.inputs_by_role(Role.PARAM) if v.meta.is_float}
    for op in graph.ops:
        rule = rule_for(op.kind)
        if rule.differentiable and any(r in need for r in op.refs()):
            outs = op.outputs if rule.grad_outputs is None else \
                [op.outputs[i] for i in rule.grad_outputs]
            need.update(o for o in outs if o >= 0 and graph.values[o].meta.carries_grad)
    return need


def _emit_backward(b: GraphBuilder, graph: Graph, needs: set[int], m: int,
                   scale: int | None) -> dict[int, Ref]:
    """Emit the backward ops; returns the total gradient of each graph input."""
    contribs: dict[int, list[tuple[Ref, str]]] = {}
    e = Emitter(b, phase=Phase.BACKWARD, module_path="", grad_of=-1)
    meta = b.meta(graph.loss)  # the seed is made, not derived from the loss: nothing in
    (seed_id,) = e.emit("aten.full.default", (meta.shape, 1.0 / m), (meta,),  # the step
                        (("dtype", meta.dtype), ("device", DEVICE)))     # waits for its value
    seed = Ref(seed_id)
    if scale is not None:
        seed = e.call("aten.mul.Tensor", seed, Ref(scale))
    contribs[graph.loss] = [(seed, "")]
    for op in reversed(graph.ops):
        if not any(o in contribs for o in op.outputs):
            continue
        e = Emitter(b, phase=Phase.BACKWARD, module_path=op.module_path, grad_of=op.id)
        gouts = tuple(_total(b, contribs.pop(o, None), op) for o in op.outputs)
        b.grads += [(o, g.id) for o, g in zip(op.outputs, gouts) if g is not None]
        if not any(r in needs for r in op.refs()):
            continue
        try:
            pairs = rule_for(op.kind).grad(e, op, gouts, lambda r: r.id in needs)
        except CaptureError:
            raise
        except Exception as err:  # a rule met arguments it cannot handle
            raise CaptureError(f"no gradient for {op.kind} at module '{op.module_path}' "
                               f"({op.source}): {type(err).__name__}: {err}") from err
        for x, g in pairs:
            _check_grad(b, x, g, op)
            if b.meta(g.id).dtype != b.meta(x.id).dtype:  # as autograd: a gradient
                g = e.call("aten._to_copy.default", g, dtype=b.meta(x.id).dtype)  # has x's dtype
            contribs.setdefault(x.id, []).append((g, op.module_path))
    grads = {}
    for v in graph.inputs:
        total = _total(b, contribs.get(v), None)
        if total is not None:
            grads[v] = total
            b.grads.append((v, total.id))
    return grads


def _total(b: GraphBuilder, contribs, fwd: Op | None) -> Ref | None:
    """One gradient from its contributions, via `meshplan.grad_sum` if many."""
    if not contribs:
        return None
    if len(contribs) == 1:
        return contribs[0][0]
    path = contribs[-1][1]
    e = Emitter(b, phase=Phase.BACKWARD, module_path=path,
                grad_of=fwd.id if fwd is not None else -1)
    return e.call(GRAD_SUM, *(g for g, _ in contribs))


def _check_grad(b: GraphBuilder, x: Ref, g: Ref, op: Op) -> None:
    gm, xm = b.meta(g.id), b.meta(x.id)
    assert gm.shape == xm.shape, (
        f"gradient rule of {op.kind} gave shape {gm.shape} for an input of shape {xm.shape}")


def _owner(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _emit_accumulate(b: GraphBuilder, graph: Graph, grads: dict[int, Ref]) -> dict[int, Ref]:
    accs = {}
    for p in graph.inputs_by_role(Role.PARAM):
        if p.id not in grads:
            continue
        acc_in = b.add_input(p.meta, Role.GRAD, str(StateName.grad(p.name)))
        e = Emitter(b, phase=Phase.BACKWARD, module_path=_owner(p.name))
        acc = e.call(ACCUMULATE_GRAD, Ref(acc_in), grads[p.id])
        b.updates.append(Update(str(StateName.grad(p.name)), acc.id))
        accs[p.id] = acc
    return accs


def _emit_optimizer(b: GraphBuilder, graph: Graph, accs: dict[int, Ref], opt: OptimizerConfig):
    params = [p for p in graph.inputs_by_role(Role.PARAM) if p.id in accs]
    norm = opt.guard is not None and bool(params)  # the norm: clipping, or the guard's
    slots = {p.id: _slots(b, p, opt) for p in params} if norm else {}
    coef = _emit_clip(b, params, accs, slots, opt.max_grad_norm) if norm else None
    extra = {"coef": coef} if opt.max_grad_norm is not None and norm else {}
    if opt.lr_schedule.scheduled:  # the rate is a state the runtime sets before each STEP
        extra["lr"] = Ref(b.add_input(TensorMeta((), DType("float64")), Role.OPT_STATE, LR))
        b.add_input(TensorMeta((), DType("float64")), Role.OPT_STATE, STEP_COUNT)
    for p in params:
        e = Emitter(b, phase=Phase.OPTIMIZER, module_path=_owner(p.name))
        kw = dict(opt.kwargs()) | extra
        if not opt.decays(p.name, p.meta.shape):
            kw["weight_decay"] = 0.0
        args = slots[p.id] if norm else _slots(b, p, opt)
        outs = e.call_multi(optimizer_kind(opt.kind), Ref(p.id), accs[p.id], *args, **kw)
        b.updates.append(Update(p.name, outs[0].id))
        for slot, out in zip(SLOTS[opt.kind], outs[1:]):
            b.updates.append(Update(str(StateName(p.name, slot)), out.id))


def _slots(b: GraphBuilder, p, opt: OptimizerConfig) -> list[Ref]:
    """Parameter `p`'s optimizer slots, new inputs."""
    return [Ref(b.add_input(TensorMeta(slot_meta_shape(slot, p.meta.shape),
                                       DType("float32") if slot == "step" else p.meta.dtype),
                            Role.OPT_STATE, str(StateName(p.name, slot))))
            for slot in SLOTS[opt.kind]]


def _emit_clip(b: GraphBuilder, params, accs: dict[int, Ref], slots: dict,
               max_norm: float | None) -> Ref:
    """Global-norm clipping: each gradient's squared norm (reading the
    optimizer's tensors, so it is laid out as the optimizer's gradient), their
    sum, and the factor every optimizer op takes; the norm is the state
    `GRAD_NORM`, reported each step. Planning sums the squares per stage and
    across stages (passes/grad_norm.py)."""
    squares = []
    for p in params:
        e = Emitter(b, phase=Phase.OPTIMIZER, module_path=_owner(p.name))
        squares.append(e.call(GRAD_SQ, Ref(p.id), accs[p.id], *slots[p.id]))
    e = Emitter(b, phase=Phase.OPTIMIZER, module_path="")
    total = e.call(SQ_SUM, *squares)
    norm, coef = e.call_multi(CLIP_COEF, total,  # no clipping: the guard's norm only
                              max_norm=float("inf") if max_norm is None else float(max_norm))
    b.add_input(TensorMeta((), DType("float32")), Role.OPT_STATE, GRAD_NORM)
    b.updates.append(Update(GRAD_NORM, norm.id))
    return coef
