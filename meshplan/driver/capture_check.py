"""The capture self-check: the captured forward computes what the module does.

Invariants:
- It runs only on real example inputs and weights: a capture on the meta
  device (the zoo's, for planning) has nothing to compute.
- The captured forward runs through meshplan's own executor code
  (`runtime.codegen.compile_segment`, the rule table's kernels), the
  module through its own eager `forward`, each on its own copy of the
  inputs, under `no_grad`; the module's random calls draw the numbers the
  graph's random ops draw (`same_masks.py`, at step 0, micro-batch 0).
- The module is left as it was: its buffers (BatchNorm's running stats,
  counters) and the RNG state are restored.
- A loss beyond rounding of the module's own is a `CaptureError` naming the
  first op whose output differs, with its module path and source line. It is
  found by running the graph again, keeping every value (the first run keeps
  the loss alone), and comparing each with the value of the
  same fx node in torch's own run of the exported program
  (`torch.fx.Interpreter`); where those all agree, the difference is
  export's, and the message says so.
- Once the losses agree, each trained parameter's gradient through torch's
  program as exported (torch's autograd over its aten ops) is compared with
  the module's own backward, within the same bound: what export drops (a
  gradient hook, a `no_grad` inside `autocast`) is a `CaptureError` naming
  the parameter.
- Then meshplan's own backward (`autodiff`: the rule table's gradients, run
  by the executor's code) is judged the same way against the module's own,
  its random ops drawing the graph's numbers: a rule that is wrong for
  what a model feeds it (a complex product's conjugate, once) is a
  `CaptureError` naming the parameter, not a run that trains wrong. Each
  tensor's bound is relative to its largest gradient, floored at a
  hundredth of the largest of all (a gradient that is zero but for
  rounding, a bias before a norm, is judged on the scale of the others).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch

from meshplan.autodiff import build_train_step
from meshplan.capture.export import Traced, trace, where
from meshplan.driver.same_masks import SameMasks
from meshplan.errors import CaptureError
from meshplan.ir import Graph, Phase, Ref, Role
from meshplan.ir.choices import Precision
from meshplan.ir.state_name import StateName
from meshplan.ops import random_ops
from meshplan.runtime.codegen import compile_segment
from meshplan.runtime.live_bytes import LiveBytes
from meshplan.runtime.state import own_tensor, weights_of

_LOG = logging.getLogger(__name__)
SEED = 1234
# fp32 rounding over a whole forward: kernels that sum in another order
# (attention, a cross-entropy split into log-softmax and nll) may differ by a
# few ulps per op. Measured, the loss's relative difference: 0 for GPT and
# BERT small and for transformers' gpt2, bert, llama, gptj and xlm-roberta,
# 1.0e-7 for ResNet small. A miscompile is orders of magnitude beyond it.
RTOL_FP32 = 1e-4


def checked_capture(module, inputs: tuple, loss_fn=None, targets: tuple = (),
                    self_check: bool = True,
                    precision: Precision | str = Precision.FP32) -> Graph:
    """`capture`, then (on real inputs and weights, unless `self_check` is
    False) the self-check: a `CaptureError` if the captured forward's loss
    differs from the module's own. The check runs on the fp32 capture, the
    module's own forward; a bf16/fp16 capture (the model's casts resolved
    under autocast) is traced after it."""
    checks = self_check and _is_real(module, (*inputs, *targets))
    if checks or Precision(precision) is Precision.FP32:
        traced = trace(module, tuple(inputs), loss_fn, tuple(targets))
        if checks:
            check_capture(traced, module, tuple(inputs), loss_fn, tuple(targets))
        if Precision(precision) is Precision.FP32:
            return traced.graph
    return trace(module, tuple(inputs), loss_fn, tuple(targets), precision).graph


def check_capture(traced: Traced, module, inputs: tuple, loss_fn=None,
                  targets: tuple = ()) -> None:
    """Raise `CaptureError` unless `traced.graph`'s loss on `inputs` equals,
    within rounding, the module's own eager loss."""
    with _kept(module):
        eager = _eager_loss(module, inputs, loss_fn, targets)
    graph, args = traced.graph, (*inputs, *targets)
    with _kept(module):  # the loss alone: each value is freed after its last use
        mine = _run_graph(graph, module, args, keeps=[graph.loss])[graph.loss]
    if _close(mine, eager):
        _check_gradients(traced, module, inputs, loss_fn, targets)
        return
    with _kept(module):  # every value, to find the first that differs
        env = _run_graph(graph, module, args, [o for op in graph.ops for o in op.outputs])
    with _kept(module):
        torch_values = _program_values(traced, module, args)
    name = type(module).__name__
    head = (f"capture self-check: {name}'s captured forward gives loss {float(mine):.6g}, "
            f"its own forward {float(eager):.6g}")
    culprit = _first_difference(traced, env, torch_values)
    if culprit is None:
        raise CaptureError(f"{head}; torch.export's program differs from the module itself "
                           "(the forward reads something export does not capture: a Python "
                           "global, a tensor's .item()); pass self_check=False to capture "
                           "anyway")
    raise CaptureError(f"{head}; the first op that differs is {culprit}; this is a meshplan "
                       "bug: report it, or pass self_check=False to capture anyway")


def _check_gradients(traced: Traced, module, inputs: tuple, loss_fn, targets: tuple) -> None:
    """The two gradient checks: torch's through the exported program, then
    meshplan's own backward, each against the module's own backward."""
    trained = {n: p for n, p in module.named_parameters() if p.requires_grad}
    if not trained:
        return
    try:  # random calls draw torch's numbers, as the exported program's do
        eager = _eager_grads(module, trained, inputs, loss_fn, targets, same_masks=False)
        _check_export_gradients(traced, module, (*inputs, *targets), trained, *eager)
        if _has_random_ops(traced.graph):  # the graph's random ops draw SameMasks' numbers
            eager = _eager_grads(module, trained, inputs, loss_fn, targets, same_masks=True)
    except RuntimeError as e:  # no derivative, no parameter the loss depends on, ...
        _LOG.debug("capture self-check: gradients not compared: %s", e)
        return
    _check_autodiff(traced.graph, module, (*inputs, *targets), dict(zip(trained, eager[1])))


def _eager_grads(module, trained: dict, inputs: tuple, loss_fn, targets: tuple,
                 same_masks: bool) -> tuple:
    """(the module's own loss, its gradient of each of `trained`, or None)."""
    with _kept(module), torch.enable_grad():
        with SameMasks().at(0, 0) if same_masks else nullcontext():
            loss = _module_loss(module, inputs, loss_fn, targets)
        return loss, torch.autograd.grad(loss, list(trained.values()), allow_unused=True)


def _check_export_gradients(traced: Traced, module, args: tuple, trained: dict, eager_loss,
                            eager: tuple) -> None:
    """Raise `CaptureError` if a trained parameter's gradient through torch's
    exported program (torch's autograd over its aten ops) differs from the
    module's own backward (`eager`), which no forward value shows. Measured,
    torch 2.13: export drops a gradient hook (`register_hook`) and traces a
    `torch.no_grad()` inside a `torch.autocast` block as plain ops (a
    `torch.autograd.Function`'s backward, which it drops too, capture keeps:
    `capture/functions.py`). Skipped where the two forwards differ (random
    ops drawn otherwise)."""
    leaf = {id(p): p.detach().requires_grad_() for p in trained.values()}
    with _kept(module), torch.enable_grad():
        loss = _program_loss(traced, module, args, leaf)
        if not _close(loss, eager_loss):
            return
        mine = torch.autograd.grad(loss, list(leaf.values()), allow_unused=True)
    for name, a, b in zip(trained, mine, eager):
        a, b = (torch.zeros_like(trained[name]) if g is None else g for g in (a, b))
        if not _close(a, b):
            raise CaptureError(
                f"capture self-check: {type(module).__name__}'s gradient of '{name}' through "
                "torch.export's program differs from its own backward (max |diff| "
                f"{float((a.double() - b.double()).abs().max()):.3g}): export drops a "
                "gradient hook (register_hook) and a torch.no_grad() inside torch.autocast; "
                "write the gradient with tensor ops (a straight-through estimator: x + "
                "(f(x) - x).detach()) or a torch.autograd.Function, or pass "
                "self_check=False to capture anyway")


def _check_autodiff(graph: Graph, module, args: tuple, eager: dict) -> None:
    """Raise `CaptureError` if a parameter's gradient through meshplan's
    backward of `graph` (one micro-batch, no optimizer) differs from
    `eager` ({name: the module's own gradient, or None})."""
    try:
        step = build_train_step(graph)
    except CaptureError:  # planning says it, in its own words
        return
    made = {u.name: u.value for u in step.updates}
    grad_of = {n: made[str(StateName.grad(n))] for n in eager if str(StateName.grad(n)) in made}
    ops = [op for op in step.ops if op.phase is not Phase.OPTIMIZER]
    try:
        with _kept(module):
            env = _run_graph(step, module, args, list(grad_of.values()), ops)
    except torch.OutOfMemoryError:  # the device's limit, not a fault of the backward
        raise
    except RuntimeError as e:  # it would fail the same way in the run's first step
        raise CaptureError(
            f"capture self-check: meshplan's backward of {type(module).__name__} fails on "
            f"the example: {type(e).__name__}: {str(e).splitlines()[0][:200]}; this is a "
            "meshplan bug: report it, or pass self_check=False to capture anyway") from e
    params = {v.name for v in graph.inputs_by_role(Role.PARAM)}
    pairs = {}  # name -> (meshplan's gradient, the module's); a missing one is zero
    for n, b in eager.items():
        a = env.get(grad_of.get(n, -1))
        if n in params and (a is not None or b is not None):
            pairs[n] = (torch.zeros_like(b) if a is None else a,
                        torch.zeros_like(a) if b is None else b)
    floor = max((float(b.detach().abs().max()) for _, b in pairs.values() if b.numel()),
                default=0.0) / 100
    for name, (a, b) in pairs.items():
        if not _close(a, b, floor):
            raise CaptureError(
                f"capture self-check: meshplan's gradient of '{name}' differs from "
                f"{type(module).__name__}'s own backward (max |diff| "
                f"{float((a.double() - b.double()).abs().max()):.3g}, its largest "
                f"{float(b.abs().max()):.3g}); this is a meshplan bug: report it, or pass "
                "self_check=False to capture anyway")


def _has_random_ops(graph: Graph) -> bool:
    return any(op.kind in random_ops.KERNELS for op in graph.ops)


def _program_loss(traced: Traced, module, args: tuple, leaf: dict):
    """The loss of torch's own run of the program as exported (its writes in
    place: torch's autograd differentiates them, not the functional
    program's `aten.copy`), its trained parameters the tensors `leaf` gives
    (by the identity of the module's); its buffers are the module's own, as
    `_kept` restores them."""
    ep = traced.exported
    outs = torch.fx.Interpreter(ep.graph_module).run(
        *_program_inputs(traced, module, args, leaf, ep))
    kinds = [spec.kind.name for spec in ep.graph_signature.output_specs]
    return outs[next(i for i, k in enumerate(kinds) if k in ("USER_OUTPUT", "LOSS_OUTPUT"))]


def _is_real(module, tensors: tuple) -> bool:
    weights = list(module.parameters()) + list(module.buffers())
    return all(isinstance(t, torch.Tensor) and not t.is_meta for t in (*tensors, *weights))


@contextmanager
def _kept(module):
    """Run a forward from `SEED`, then restore the module's buffers and the
    RNG state as they were."""
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    devices = sorted({t.device.index or 0 for t in module.parameters() if t.is_cuda})
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(SEED)
        try:
            yield
        finally:
            for n, b in module.named_buffers():
                b.copy_(buffers[n])


def _copies(tensors: tuple) -> tuple:
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in tensors)


def _eager_loss(module, inputs: tuple, loss_fn, targets: tuple) -> torch.Tensor:
    with SameMasks().at(0, 0):  # the captured graph's random ops draw at (0, 0) alike
        return _module_loss(module, inputs, loss_fn, targets)


def _module_loss(module, inputs: tuple, loss_fn, targets: tuple) -> torch.Tensor:
    """The module's own loss on copies of `inputs` and `targets`."""
    out = module(*_copies(inputs))
    return loss_fn(out, *_copies(targets)) if loss_fn is not None else out


def _run_graph(graph: Graph, module, args: tuple, keeps: list[int],
               ops=None) -> dict[int, torch.Tensor]:
    """The values `keeps` of `graph` (its `ops`, default all), run as the
    executor runs a segment; a gradient accumulator starts empty (None)."""
    own = weights_of(module)
    data = iter(_copies(args))
    ops = graph.ops if ops is None else ops
    read = {r for op in ops for r in op.refs()}
    env = {}
    for vid in graph.inputs:
        v = graph.values[vid]
        if v.role is Role.DATA:
            env[vid] = next(data)
        elif vid in read:
            env[vid] = None if v.role is Role.GRAD else own_tensor(own, graph, v.name)
    device = next((t.device for t in env.values() if t is not None), torch.device("cpu"))
    fn = compile_segment(ops, reads=list(env),
                         keeps=[k for k in keeps if k >= 0],
                         device=device, name="self_check", borrowed=list(env))
    return fn(env, LiveBytes())


def _program_values(traced: Traced, module, args: tuple) -> dict[str, object]:
    """Every fx node's value in torch's own run of the exported program."""
    values: dict[str, object] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            values[n.name] = out = super().run_node(n)
            return out

    Recorder(traced.program.graph_module).run(*_program_inputs(traced, module, args))
    return values


def _program_inputs(traced: Traced, module, args: tuple, leaf: dict | None = None,
                    ep=None) -> list:
    """The inputs of the exported program `ep` (default: the functional one):
    copies of `args`, its constants, and the module's parameters and buffers
    (a parameter as `leaf` has it, by the identity of the module's tensor,
    where it does)."""
    ep, leaf = ep or traced.program, leaf or {}
    own = weights_of(module)
    named = dict(module.named_parameters(remove_duplicate=False))
    data = iter(_copies(args))
    flat = []
    for spec in ep.graph_signature.input_specs:
        kind = spec.kind.name
        if kind == "USER_INPUT":
            flat.append(next(data))
        elif kind == "CONSTANT_TENSOR" and spec.target in ep.constants:
            flat.append(ep.constants[spec.target])
        else:
            name = spec.target.removeprefix(traced.prefix)
            flat.append(leaf.get(id(named.get(name)), own[name]))
    return flat


def _first_difference(traced: Traced, env: dict, torch_values: dict) -> str | None:
    """`kind at module 'path' (source): max |diff| d` of the first captured
    value, in program order, that differs from torch's own; None if none."""
    producer = {o: op for op in traced.graph.ops for o in op.outputs}
    for node in traced.program.graph.nodes:
        ref, theirs = traced.refs.get(node.name), torch_values.get(node.name)
        if not isinstance(ref, Ref) or not isinstance(theirs, torch.Tensor):
            continue
        op = producer.get(ref.id)
        if op is None or ref.id not in env or _close(env[ref.id], theirs):
            continue
        mine = env[ref.id]
        diff = (f"shape {list(mine.shape)} for {list(theirs.shape)}"
                if mine.shape != theirs.shape else
                f"max |diff| {float((mine.double() - theirs.double()).abs().max()):.3g}")
        made_by = "" if op.kind == str(node.target) else f" (captured as {op.kind})"
        return f"{node.target}{made_by} at {where(_written_at(node), traced.prefix)}: {diff}"
    return None


def _written_at(node):
    """The node whose source line a user recognises: for the `*_scatter` that
    functionalization makes where a view's base is next read, the write into
    the view (its `src`); for a tensor constant (a placeholder: no line), its
    first reader; else the node itself."""
    if node.op != "call_function":
        return next(iter(node.users), node)
    src = node.args[1] if len(node.args) > 1 else None
    if str(node.target).split(".")[1].endswith("_scatter") and isinstance(src, torch.fx.Node):
        return src
    return node


def _close(mine: torch.Tensor, theirs: torch.Tensor, floor: float = 1.0) -> bool:
    """Within rounding: relative to `theirs`' largest magnitude, or `floor`
    where that is smaller."""
    if mine.shape != theirs.shape:
        return False
    if not theirs.is_floating_point():
        return bool(torch.equal(mine.to(theirs.dtype), theirs))
    a, b = mine.detach().double(), theirs.detach().double()
    rtol = max(RTOL_FP32, 16 * torch.finfo(theirs.dtype).eps)
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool(((a - b).abs() <= rtol * max(scale, floor)).all()) and \
        bool(torch.isfinite(a).eq(torch.isfinite(b)).all())
