"""capture: `nn.Module` -> forward `Graph`, through `torch.export`.

Invariants:
- The export is the training IR (not decomposed), non-strict; a module on
  the meta device is traced on fake CPU tensors, and one for bf16/fp16
  under autocast (`capture/model_casts.py`).
- Every op keeps its module path (`blocks.3.attn.qkv`) and source line;
  params and buffers keep their FQNs, shapes and dtypes.
- The graph ends in a scalar loss: the model's output, or `loss_fn(output,
  *targets)` when a `loss_fn` is given.
- Mutation is functionalized by torch itself: a program that mutates
  anything (an in-place op, a write through a view, a buffer updated by
  BatchNorm) is rerun through `ExportedProgram.run_decompositions({})`,
  which decomposes nothing but turns every in-place op into torch's
  functional form (`copy_` into a slice -> `slice_scatter`, ...) and every
  mutated buffer into an output; that output becomes an `Update`. Capture
  itself rewrites no mutation ([Note: mutation], docs/concepts/capture.md).
- A `torch.no_grad()`, `enable_grad()` or `autocast` region of the forward
  is inlined by the same call, each value leaving a grad-disabled region
  detached first (`capture/grad_regions.py`): no gradient flows back
  through it, as in eager PyTorch.
- Ops are rewritten into canonical forms (`ops.canonical`).
- A parameter with `requires_grad` off is state the step reads and never
  trains (a `BUFFER`): no gradient, no optimizer slot, as in eager torch.
- A tied parameter (one tensor under several names) is one input; its
  other names are recorded as aliases (`Graph.aliases`).
- The module's structure (layer list, declared tp plan, head and vocabulary
  counts) is recorded for derived plans (`capture/structure.py`).
- A tensor constant that is no parameter or buffer (transformers' attention
  lifts some) becomes an `aten.full` op when its elements are equal, else
  (up to `CONSTANT_ELEMENTS`) ops that make it element by element.
- Shapes are export's own (`node.meta["val"]`); inference runs only for ops
  that capture itself creates.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from meshplan.capture.grad_regions import detach_no_grad_values, has_regions
from meshplan.capture.model_casts import (
    autocast_flow,
    is_fake,
    lower_inside,
    on_fake_device,
)
from meshplan.capture.routed_experts import fuse_routed_experts
from meshplan.capture.structure import structure_facts
from meshplan.capture.torch_export import (
    TORCH_DIR,
    export_program,
    first_line,
    short,
    torch_noise,
)
from meshplan.errors import CaptureError
from meshplan.ir import (
    DEVICE,
    DType,
    Graph,
    GraphBuilder,
    Ref,
    Role,
    TensorMeta,
    Update,
    check_well_formed,
)
from meshplan.ir.choices import Precision
from meshplan.ir.graph_facts import GraphFacts
from meshplan.ops.emit import Emitter
from meshplan.ops.random_ops import draws
from meshplan.ops.resolve import modules_of
from meshplan.ops.table import rule_for

CONSTANT_ELEMENTS = 64  # a constant the forward makes, element by element, at most
_SKIP = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
}
_READS_VALUE = {"aten.item.default", "aten._local_scalar_dense.default"}
_ROLE = {"PARAMETER": Role.PARAM, "BUFFER": Role.BUFFER, "CONSTANT_TENSOR": Role.BUFFER,
         "USER_INPUT": Role.DATA}


class _WithLoss(nn.Module):
    """Wraps a model whose output needs `loss_fn` to become a scalar loss."""

    def __init__(self, model: nn.Module, loss_fn, n_inputs: int):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.n_inputs = n_inputs

    def forward(self, *args):
        out = self.model(*args[: self.n_inputs])
        return self.loss_fn(out, *args[self.n_inputs:])


@dataclass
class _Ctx:
    """Capture state: fx node -> the Ref(s) standing for its output(s)."""

    builder: GraphBuilder
    env: dict = field(default_factory=dict)
    input_name: dict[str, str] = field(default_factory=dict)  # export target -> input name
    frozen: frozenset[str] = frozenset()  # parameters that take no gradient (requires_grad off)
    random_ops: int = 0  # random ops so far: the next one's key (ops/random_ops.py)

    def ref(self, node) -> Ref:
        return self.env[node]

    def random_key(self) -> int:
        """The next random op's key: its ordinal in program order."""
        self.random_ops += 1
        return self.random_ops - 1


@dataclass(frozen=True)
class Traced:
    """A capture with what the self-check needs to find the op that differs
    (`driver/capture_check.py`): the functional program torch exported, and
    for each of its fx nodes the Ref(s) standing for its output(s); the
    program as exported (mutations in place, which torch's autograd can
    differentiate: `aten.copy` has no derivative), its no-grad values detached."""

    graph: Graph
    program: torch.export.ExportedProgram
    refs: dict[str, Ref | tuple]
    prefix: str  # what the program's parameter names carry before the module's FQNs
    exported: torch.export.ExportedProgram


def capture(module: nn.Module, inputs: tuple, loss_fn=None, targets: tuple = (),
            precision: Precision | str = Precision.FP32) -> Graph:
    """Capture `module` on example `inputs` as a forward Graph ending in a loss.

    With `loss_fn`, the loss is `loss_fn(module(*inputs), *targets)`.
    Works on a module built on the `meta` device (no weights allocated).
    `precision` is the one the graph will be planned in: under bf16/fp16 the
    model's own casts resolve as under autocast (`capture/model_casts.py`)."""
    return trace(module, inputs, loss_fn, targets, precision).graph


def trace(module: nn.Module, inputs: tuple, loss_fn=None, targets: tuple = (),
          precision: Precision | str = Precision.FP32) -> Traced:
    """`capture`, keeping the exported program and each fx node's Refs."""
    precision = Precision(precision)
    model = _WithLoss(module, loss_fn, len(inputs)) if loss_fn is not None else module
    args = tuple(inputs) + tuple(targets)
    prefix = "model." if loss_fn is not None else ""
    name = type(module).__name__
    with on_fake_device(model, args) as traced_on, autocast_flow(precision, traced_on):
        exported = export_program(model, traced_on, name)
        if precision is not Precision.FP32:
            lower_inside(exported.graph_module, precision)
        ep = functional(exported, name, retrace=precision is not Precision.FP32)
    same = _tensor_ids(module)
    frozen = frozenset(n for n, p in module.named_parameters(remove_duplicate=False)
                       if not p.requires_grad)
    graph, env = _translate(ep, prefix, type(module).__name__, same, frozen)
    graph = fuse_routed_experts(graph)
    ran = frozenset(op.module_path.removeprefix(prefix) for op in graph.ops)
    graph = replace(graph, facts=replace(graph.facts, aliases=_aliases(same, graph),
                                         structure=structure_facts(module, ran),
                                         op_modules=modules_of(graph.ops),
                                         captured_for=precision))
    check_well_formed(graph)
    return Traced(graph, ep, {node.name: r for node, r in env.items()}, prefix, exported)


# [Note: mutation] Export's training IR keeps in-place ops as they are
# (`copy_` into a `slice` of a tensor, `add_` on a view), and CompositeImplicit
# ops such as `batch_norm` mutate their buffers without saying so in their
# schema (`OpRule.mutates` knows both). Rewriting `x.f_()` as `y = f(x)` by
# hand loses every write through a view (issue 29: `s[..., 1:] = x[..., :-1]`
# trained silently wrong), so capture hands the whole program to torch's
# functionalization instead. It costs a second trace (benchmarks/results/
# capture_cost.md: ResNet-50's BatchNorms, 1.82 -> 3.81 s with the
# self-check), paid only by programs that mutate: a program with no mutating
# node is already functional, and is what functionalization would return.
def functional(ep, model_name: str, retrace: bool = False):
    """`ep` with every mutation functionalized by torch, and its grad-mode
    and autocast regions inlined (`capture/grad_regions.py`; itself if it
    has neither, unless `retrace`: a program traced under autocast, whose
    casts the retrace inlines)."""
    mutates = any(node.op == "call_function" and str(node.target).startswith("aten.")
                  and rule_for(str(node.target)).mutates for node in ep.graph.nodes)
    regions = has_regions(ep.graph_module)
    if not mutates and not regions and not retrace:
        return ep
    if regions:  # their mutations are inside them, where the scan above does not look
        detach_no_grad_values(ep.graph_module)
    try:
        with torch_noise():
            return ep.run_decompositions({})
    except Exception as e:  # torch raises many kinds; the first line says what
        raise CaptureError(f"torch could not functionalize the mutation in "
                           f"{model_name}: {first_line(e)}; write the "
                           "value out of place (e.g. torch.cat, torch.where)") from e


def _tensor_ids(module: nn.Module) -> dict[str, int]:
    """Every name of every parameter and buffer -> the identity of its tensor."""
    return {name: id(t) for name, t in (*module.named_parameters(remove_duplicate=False),
                                         *module.named_buffers(remove_duplicate=False))}


def _aliases(same: dict[str, int], graph: Graph) -> tuple[tuple[str, str], ...]:
    """(name, graph input name) for every other name of a tied
    parameter or buffer: `named_parameters()` dedups, and export may name a
    shared tensor once or under each name, so only identity finds them all."""
    input_of = {same.get(graph.values[v].name): graph.values[v].name for v in graph.inputs}
    out = [(name, input_of[key]) for name, key in same.items()
           if key in input_of and input_of[key] != name]
    return tuple(sorted(out))


def _translate(ep, prefix: str, model_name: str, same: dict[str, int],
               frozen: frozenset[str] = frozenset()) -> tuple[Graph, dict]:
    ctx = _Ctx(builder=GraphBuilder(), frozen=frozen)
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    loss = None
    first: dict[int, Ref] = {}  # tensor identity -> the input made for it
    checks = _checks_only(ep.graph)
    for node in ep.graph.nodes:
        if node in checks:
            continue
        if node.op == "placeholder":
            spec = specs[node.name]
            if spec.kind.name == "CONSTANT_TENSOR" and spec.target not in same:
                ctx.env[node] = _constant(ctx, ep.constants[spec.target], spec.target, node)
                continue
            key = same.get(spec.target.removeprefix(prefix)) if spec.target else None
            if key is not None and key in first:  # a tied tensor's second name: one input
                ctx.env[node] = first[key]
                ctx.input_name[spec.target] = ctx.builder.values[first[key].id].name
                continue
            _add_input(ctx, node, spec, prefix)
            if key is not None:
                first[key] = ctx.env[node]
        elif node.op == "call_function":
            _add_call(ctx, node, prefix)
        elif node.op == "output":
            loss = _outputs(ctx, ep, node, model_name)
    assert loss is not None
    return ctx.builder.build(loss.id, GraphFacts(model_class=model_name)), ctx.env


def _checks_only(graph) -> set:
    """The nodes computed only for a check on the data (`assert
    lengths.max().item() <= slen`: an `item` and the ops before it, feeding
    `_assert_scalar` alone). A check computes nothing the model returns, and
    a value read off the device is no tensor a plan can hold, so capture
    leaves them out, as it leaves the asserts (`_SKIP`)."""
    dropped: set = set()
    for node in reversed(graph.nodes):
        users = list(node.users)
        if (node.op == "call_function" and users
                and not (str(node.target).startswith("aten.")
                         and rule_for(str(node.target)).mutates)
                and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())
                and all(str(u.target) in _SKIP or u in dropped for u in users)):
            dropped.add(node)
    return dropped


def _outputs(ctx: _Ctx, ep, node, model_name: str) -> Ref:
    """The loss; a mutated buffer's new value becomes its `Update`. A mutated
    input is one micro-batch's tensor, which the step reads no more."""
    outs = node.args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    user = []
    for spec, out in zip(ep.graph_signature.output_specs, outs):
        kind = spec.kind.name
        if kind == "BUFFER_MUTATION":
            ctx.builder.updates.append(Update(ctx.input_name[spec.target], ctx.ref(out).id))
        elif kind in ("USER_OUTPUT", "LOSS_OUTPUT"):
            user.append(out)
        elif kind != "USER_INPUT_MUTATION":
            raise CaptureError(f"{model_name} writes to {spec.target or 'a tensor'} in its "
                               f"forward ({kind.lower()}); only buffers may change in a "
                               "training step: register it with register_buffer(...)")
    return _loss_of(ctx, user, model_name)


class ConstantOnMeta(CaptureError):
    """A tensor constant made in the forward of a module on the meta device
    (falcon's `qkv[..., [-2]]`): its value is not known; capture again with
    weights."""


def _constant(ctx: _Ctx, t: torch.Tensor, name: str, node) -> Ref:
    """A tensor constant of the forward (not a parameter or buffer: no state
    holds it) as ops that make it: `aten.full` when all its elements are
    equal (empty and scalar constants, as transformers' attention lifts),
    else, up to `CONSTANT_ELEMENTS`, each element an `aten.scalar_tensor`
    stacked into the constant's shape (an index list, `torch.tensor([0, 1,
    1, 3])`): the values live in the graph, so every rank makes them."""
    if (t.is_meta or is_fake(t)) and t.numel():
        raise ConstantOnMeta(f"tensor constant '{name}' ({list(t.shape)}) was made on the "
                             "meta device, so its value is unknown; capture the module with "
                             "its weights")
    flat = t.detach().flatten()
    kw = (("dtype", DType.of(t.dtype)), ("device", DEVICE))
    if not flat.numel() or bool((flat == flat[0]).all()):
        value = flat[0].item() if flat.numel() else 0
        e = Emitter(ctx.builder, module_path=_module_path(node, ""), source="")
        (out,) = e.emit("aten.full.default", (tuple(t.shape), value), (_meta(t, node),), kw)
        return Ref(out)
    # made before the first op, at the root (pipeline stages find layers contiguous),
    # and named by the line of its first reader (a placeholder has none)
    at = next(iter(node.users), node)
    e = Emitter(ctx.builder, module_path=_module_path(node, ""), source=_source(at))
    if flat.numel() > CONSTANT_ELEMENTS:
        raise CaptureError(f"tensor constant '{name}' ({list(t.shape)}) is not a parameter or "
                           f"buffer, and has more than {CONSTANT_ELEMENTS} elements to make on "
                           f"every rank; register it with register_buffer(...) [{_where(at)}]")
    one = TensorMeta.of(flat[0])
    parts = [e.emit("aten.scalar_tensor.default", (x,), (one,), kw)[0] for x in flat.tolist()]
    (stacked,) = e.emit("aten.stack.default", (tuple(Ref(p) for p in parts),),
                        (TensorMeta.of(flat),))
    (out,) = e.emit("aten.view.default", (Ref(stacked), tuple(t.shape)), (_meta(t, node),))
    return Ref(out)


def _add_input(ctx: _Ctx, node, spec, prefix: str) -> None:
    kind = spec.kind.name
    if kind not in _ROLE:
        raise CaptureError(f"unsupported graph input kind {kind} for {node.name}")
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise CaptureError(f"input {node.name} is not a tensor ({type(val).__name__}); "
                           "pass tensors only, and keep other settings in the model")
    name = spec.target.removeprefix(prefix) if spec.target else node.name
    role = Role.BUFFER if name in ctx.frozen else _ROLE[kind]  # frozen: state, never trained
    vid = ctx.builder.add_input(_meta(val, node), role, name)
    ctx.env[node] = Ref(vid)
    if spec.target:
        ctx.input_name[spec.target] = name


def _meta(val, node) -> TensorMeta:
    if any(not isinstance(s, int) for s in val.shape):
        raise CaptureError(
            f"data-dependent shape {tuple(val.shape)} from {node.target} at {_where(node)}; "
            "meshplan plans static shapes only: avoid ops like nonzero/masked_select on the step"
        )
    return TensorMeta.of(val)


def _where(node) -> str:
    return where(node, "")


def where(node, prefix: str) -> str:
    """`module 'path' (file, line N: code)`: where an fx node's op is written."""
    return f"module '{_module_path(node, prefix) or '<root>'}' ({_source(node)})"


def _module_path(node, prefix: str) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.removeprefix(prefix.rstrip(".")).lstrip(".") if prefix else path


def _source(node) -> str:
    """`file:line: code` of the innermost frame outside torch itself."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    frames = [(lines[i], lines[i + 1] if i + 1 < len(lines) else "")
              for i in range(len(lines)) if lines[i].startswith("File ")]
    if not frames:
        return "unknown source"
    user = [f for f in frames if TORCH_DIR not in f[0]] or frames
    head, code = user[-1]
    loc = head.split(", in ")[0].removeprefix("File ").replace('"', "")
    return f"{short(loc)}: {code}"


def _lit(a, ctx: _Ctx):
    """fx argument -> IR argument (Ref or typed literal)."""
    if isinstance(a, torch.fx.Node):
        return ctx.ref(a)
    if isinstance(a, (list, tuple)):
        return tuple(_lit(x, ctx) for x in a)
    if isinstance(a, torch.dtype):
        return DType.of(a)
    if isinstance(a, torch.device):
        return DEVICE
    if isinstance(a, (torch.layout, torch.memory_format)):
        return str(a)
    return a


def _add_call(ctx: _Ctx, node, prefix: str) -> None:
    if node.target is operator.getitem:
        src, i = node.args
        ctx.env[node] = ctx.env[src][i]
        return
    kind = str(node.target)
    if kind in _SKIP:
        return
    if kind in _READS_VALUE:
        raise CaptureError(f"cannot capture {kind} at {_where(node)}: the forward reads a "
                           "tensor's value (`.item()`, `.tolist()`) and computes with it, "
                           "which a plan made before the data cannot hold; keep it a tensor")
    e = Emitter(ctx.builder, module_path=_module_path(node, prefix), source=_source(node))
    try:
        _emit_node(ctx, e, node, kind)
    except CaptureError as err:
        if "module '" in str(err):
            raise
        raise CaptureError(f"{err} [op {kind} at {_where(node)}]") from err
    except Exception as err:  # a kernel or shape function refused the op
        raise CaptureError(f"cannot capture {kind} at {_where(node)}: {first_line(err)}") from err


def _emit_node(ctx: _Ctx, e: Emitter, node, kind: str) -> None:
    if not hasattr(node.target, "_schema"):
        raise CaptureError(f"unsupported call {kind}: not an aten op, so no generic rule "
                           "applies; express it with tensor ops (e.g. torch.where for a "
                           "branch) or move it out of the model's forward")
    rule = rule_for(kind)
    assert not rule.mutates, f"{kind} survived functionalization"
    args = tuple(_lit(a, ctx) for a in node.args)
    kwargs = {k: _lit(v, ctx) for k, v in node.kwargs.items() if k not in ("layout", "pin_memory")}
    if rule.canonical is None and draws(node.target, args, kwargs):
        raise CaptureError(f"{kind} draws random numbers from torch's generator, which "
                           "differ by rank and layout; draw them with dropout, rand, randn, "
                           "randint, bernoulli or uniform_, normal_, exponential_, which "
                           "meshplan draws the same on every layout")
    val = node.meta.get("val")
    if rule.canonical is not None:
        outs = rule.canonical(e, args, kwargs, ctx)
    else:
        args = _without_memory_format(e, kind, args, kwargs)
        vals = val if isinstance(val, (list, tuple)) else (val,)
        metas = tuple(None if v is None else _meta(v, node) for v in vals)
        outs = tuple(Ref(o) for o in e.emit(kind, args, metas, tuple(kwargs.items())))
    ctx.env[node] = outs if isinstance(val, (list, tuple)) else outs[0]


def _without_memory_format(e: Emitter, kind: str, args: tuple, kwargs: dict) -> tuple:
    """The IR carries no memory formats: `preserve_format` (the default of
    the *_like ops, `to` and `clone`) is left out, and a *_like op's
    `contiguous_format` becomes the op on its input made contiguous (a no-op
    where it is); another format is refused. Returns the op's arguments."""
    fmt = kwargs.pop("memory_format", None)
    if fmt in (None, str(torch.preserve_format)):
        return args
    if fmt == str(torch.contiguous_format) and kind.endswith("_like.default"):
        return (e.call("aten.contiguous.default", args[0]), *args[1:])
    raise CaptureError(f"{kind} to memory format {fmt} is not supported; keep the default "
                       "layout (no channels_last) in the model")


def _loss_of(ctx: _Ctx, outs: list, model_name: str) -> Ref:
    out = outs[0] if len(outs) == 1 else tuple(outs)
    if not isinstance(out, torch.fx.Node):
        raise CaptureError(f"{model_name} returns {type(out).__name__}, not a scalar loss tensor; "
                           "return the loss, or pass loss_fn= to compute it from the output")
    ref = ctx.ref(out)
    m = ctx.builder.meta(ref.id)
    if m.shape != () or not m.is_float:
        raise CaptureError(f"{model_name} returns a {m.dtype.name} tensor of shape "
                           f"{list(m.shape)}, not a scalar loss; return the loss, or pass "
                           "loss_fn= to compute it from the output")
    return ref
