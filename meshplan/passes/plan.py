"""plan: the compile, from a forward Graph to the Job, as one list of passes.

    PASSES (in order; `docs/architecture.md` has the table of what each
    requires and ensures):
    check_strategy -> apply_precision (bf16, fp16)
        -> balance_sequence (cp > 1: the load-balanced order) -> autodiff
        -> expert_load (a mixture of experts)
        -> resolve_derived (derived and balanced plans) -> expand_batch_norm (dp > 1)
        -> expand_log_softmax (vocab tp) -> assign_stages
        -> share_params (a parameter read on several stages)
        -> split_norm (clipping: the norm's squares summed per stage, pp > 1)
        -> tensor_parallel -> expert_parallel (ep > 1) -> propagate_sbp
        -> context_parallel (cp > 1: every attention split) -> add_boxing
        -> recompute (full, selective)
        -> split_backward (zero-bubble schedules: I and W) -> kernel_temps -> make_job

Each pass wraps a pure function of immutable data (in its own module); the
wrappers here only move its inputs and results in and out of the
`Compilation`. Every caller (the API, the driver, the single-process
executor, the tests) runs `PASSES`, whole or with options: a train step made
by hand enters through `plan_job`, which skips precision and autodiff.

Invariant: `Compilation.graph` is always the current graph (forward, then
the train step, then the boxed graph), which the checks verify after every
pass when they are on (`passes/manager.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from meshplan.autodiff import OptimizerConfig, build_train_step
from meshplan.autodiff.split import split_backward
from meshplan.errors import ConfigError
from meshplan.ir import Graph, Role, check_well_formed
from meshplan.ir.choices import Precision, Recompute, TpStyle
from meshplan.ir.job import Job, check_job_well_formed
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.ir.sbp import Shard
from meshplan.passes.batch_norm import expand_batch_norm
from meshplan.passes.boxing import Boxed, add_boxing
from meshplan.passes.context_parallel import (
    balance_sequence,
    check_attention_split,
    gathered_keys,
    ring_note,
)
from meshplan.passes.derive import resolve_derived
from meshplan.passes.eval_mode import eval_mode
from meshplan.passes.expert_parallel import (
    expert_load,
    expert_params,
    gathered_note,
    moe_blocks,
)
from meshplan.passes.grad_norm import split_norm
from meshplan.passes.log_softmax import expand_log_softmax
from meshplan.passes.manager import Pass, PassManager
from meshplan.passes.pipeline import NotContiguous, StageAssignment, assign_stages
from meshplan.passes.precision import apply_precision
from meshplan.passes.propagate import ParamAxes, SbpAssignment, propagate_sbp
from meshplan.passes.recompute import recompute
from meshplan.passes.shared import param_readers, share_params
from meshplan.passes.strategy import check_strategy
from meshplan.passes.temps import kernel_temps
from meshplan.passes.tp_plan import tensor_parallel
from meshplan.schedules import splits_backward, stage_placement


@dataclass(slots=True)
class Compilation:
    """The compile in progress: what the passes read and write."""

    graph: Graph  # the current graph
    mesh: Mesh
    strategy: Strategy
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    notes: tuple[str, ...] = ()
    balanced: bool = False  # the forward computes on the load-balanced order (cp > 1)
    reordered: tuple[int, ...] = ()  # its data inputs in that order (kept split over cp)
    stages: StageAssignment | None = None
    copies: dict = field(default_factory=dict)  # shared parameters' per-stage gradients
    param_tp: dict = field(default_factory=dict)
    experts: frozenset = frozenset()  # expert parameters (split over ep)
    regather: frozenset = frozenset()  # values boxing converts again in each phase
    hints: dict = field(default_factory=dict)
    sbp: SbpAssignment | None = None
    boxed: Boxed | None = None
    temps: tuple = ()
    job: Job | None = None

    # What a pass reads of an earlier pass's output; the manager's requires
    # guarantee it is there.
    def staged(self) -> StageAssignment:
        assert self.stages is not None, "assign_stages has not run"
        return self.stages

    def laid_out(self) -> SbpAssignment:
        assert self.sbp is not None, "propagate_sbp has not run"
        return self.sbp

    def boxed_graph(self) -> Boxed:
        assert self.boxed is not None, "add_boxing has not run"
        return self.boxed


def _check_strategy(c: Compilation) -> None:
    c.strategy = check_strategy(c.mesh, c.strategy)
    captured, wanted = c.graph.facts.captured_for, c.strategy.precision
    fresh = c.graph.facts.train is None and c.graph.facts.precision is Precision.FP32
    if fresh and captured != wanted:  # a model's own casts resolve by the dtypes it runs in
        raise ConfigError(f"the graph was captured for {captured} but the strategy trains in "
                          f"{wanted}, and a model's own casts (x.to(input_dtype)) depend on "
                          f"the precision; capture with precision=\"{wanted}\"")


def _apply_precision(c: Compilation) -> None:
    c.graph = apply_precision(c.graph, c.strategy.precision)


def _autodiff(c: Compilation) -> None:
    s = c.strategy
    scale = s.initial_loss_scale if s.precision == Precision.FP16 else None
    c.graph = build_train_step(c.graph, c.optimizer, s.num_microbatches, loss_scale=scale)


def _expert_load(c: Compilation) -> None:
    c.graph = expert_load(c.graph)


def _resolve_derived(c: Compilation) -> None:
    c.strategy, notes = resolve_derived(c.graph, c.strategy)
    c.notes += notes


def _expand_batch_norm(c: Compilation) -> None:
    c.graph = expand_batch_norm(c.graph)


def _expand_log_softmax(c: Compilation) -> None:
    c.graph = expand_log_softmax(c.graph)


def _assign_stages(c: Compilation) -> None:
    s, n = c.strategy, len(c.graph.ops)
    one = StageAssignment((0,) * n, (0,) * n, (), (), (), ())
    if s.pp == s.vpp == 1 and not s.layer_pattern:
        c.stages = one
    elif s.pp == s.vpp == 1 and not (s.layer_stages or s.stage_layers):
        try:  # the layers only name the one stage's parts in the report
            c.stages = assign_stages(c.graph, 1, 1, s.layer_pattern)
        except NotContiguous as e:  # a layer called twice (HRM's loop) cannot be cut, nor need be
            c.stages = replace(one, notes=(f"one stage, no layers: {str(e).split(';')[0]}",))
    else:
        c.stages = assign_stages(c.graph, s.pp, s.vpp, s.layer_pattern, s.layer_stages,
                                 stage_placement(s), s.stage_layers)


def _share_params(c: Compilation) -> None:
    places = list(zip(c.staged().stage, c.staged().chunk))
    shared = share_params(c.graph, places, param_readers(c.graph, places))
    if shared.copies:
        c.graph, c.copies = shared.graph, shared.copies
        c.stages = replace(c.staged(), stage=tuple(p[0] for p in shared.places),
                           chunk=tuple(p[1] for p in shared.places))


def _split_norm(c: Compilation) -> None:
    places = list(zip(c.staged().stage, c.staged().chunk))
    c.graph, places, parts = split_norm(c.graph, places)
    c.copies = {**c.copies, **parts}
    c.stages = replace(c.staged(), stage=tuple(p[0] for p in places),
                       chunk=tuple(p[1] for p in places))


def _tensor_parallel(c: Compilation) -> None:
    s = c.strategy
    c.param_tp, c.hints, c.regather = tensor_parallel(c.graph, s.tp_plan, s.tp_axis,
                                                      s.sequence_parallel and s.tp > 1)


def _expert_parallel(c: Compilation) -> None:
    c.experts = expert_params(c.graph, c.strategy.ep)


def _propagate_sbp(c: Compilation) -> None:
    s = c.strategy
    axes = ParamAxes(s.tp_axis, s.data_axes, s.ep_axis, c.experts, s.cp_axis, s.cp_attention)
    hints = {**c.hints, **{v: {s.cp_axis: Shard(1)} for v in c.reordered}}
    if c.balanced and s.cp_attention == "auto":  # the ring computes only the pairs its
        axes = replace(axes, cp_attention="ring")  # blocks see: balanced, half the work
    c.sbp = propagate_sbp(c.graph, c.staged().stage, s.grid, c.param_tp, hints, axes, s.zero)


def _balance_sequence(c: Compilation) -> None:
    graph, data, why = balance_sequence(c.graph, c.strategy.cp)
    c.notes += (why,) if why else ()
    if graph is not None:
        c.graph, c.balanced, c.reordered = graph, True, data


def _context_parallel(c: Compilation) -> None:
    s = c.strategy
    assert s.cp_axis is not None and c.sbp is not None
    check_attention_split(c.graph, c.sbp.sigs, s.cp_axis, s.cp, c.balanced,
                          s.cp_attention == "ring")
    if s.cp_attention == "ring":
        c.notes += ring_note(c.graph, c.sbp.sigs, s.cp_axis)
    if s.cp_balance and not c.balanced:  # left in order (or a train step made by hand):
        c.strategy = replace(s, cp_balance=False)  # the Job says so; CAUSAL_OFFSET reads it


def _add_boxing(c: Compilation) -> None:
    st = c.staged()
    regather = c.regather | (frozenset(v.id for v in c.graph.inputs_by_role(Role.PARAM))
                             if c.strategy.zero.regathers else frozenset()) | \
        (gathered_keys(c.graph) if c.strategy.cp > 1 else frozenset())
    c.boxed = add_boxing(c.graph, c.laid_out(), st.stage, st.chunk, len(c.strategy.grid),
                         c.copies, regather)
    c.graph = c.boxed.graph
    if c.experts:
        c.notes += gathered_note(c.graph, c.experts, c.strategy.ep_axis)


def _recompute(c: Compilation) -> None:
    pattern = c.strategy.recompute_pattern or c.strategy.layer_pattern
    if not pattern:
        raise ConfigError("--recompute needs regions: give --recompute-pattern (or "
                          "--layer-pattern), a regex over module paths like 'blocks\\.\\d+'")
    c.boxed = recompute(c.boxed_graph(), c.strategy.recompute, pattern)
    c.graph = c.boxed.graph


def _split_backward(c: Compilation) -> None:
    b = c.boxed_graph()
    c.boxed = replace(b, graph=split_backward(b.graph, list(zip(b.stage, b.chunk))))
    c.graph = c.boxed.graph


def _kernel_temps(c: Compilation) -> None:
    c.temps = kernel_temps(c.graph, c.boxed_graph().stage, c.boxed_graph().sbp, c.strategy)


def _make_job(c: Compilation) -> None:
    b, st = c.boxed_graph(), c.staged()
    c.job = Job(graph=b.graph, mesh=c.mesh, strategy=c.strategy, stage=b.stage, chunk=b.chunk,
                sbp=b.sbp, variant=b.variant, layers=st.layers, layer_stage=st.layer_stage,
                layer_chunk=st.layer_chunk, notes=c.notes + st.notes, temps=c.temps)


def _check(c: Compilation) -> None:
    """The IR invariant check on the current graph, and on the Job once made."""
    check_well_formed(c.graph)
    if c.job is not None:
        check_job_well_formed(c.job)


def _vocab_tp(c: Compilation) -> bool:
    plan = c.strategy.tp_plan
    assert not isinstance(plan, str), "resolve_derived replaced 'derived'"
    return c.strategy.tp > 1 and any(style == TpStyle.VOCAB for _, style in plan)


F = frozenset
PASSES = PassManager([
    Pass("check_strategy", _check_strategy, F(), F({"valid_strategy"})),
    Pass("apply_precision", _apply_precision, F({"valid_strategy"}), F({"casts"}),
         when=lambda c: c.strategy.precision != Precision.FP32),
    Pass("balance_sequence", _balance_sequence, F({"valid_strategy"}), F({"sequence_order"}),
         when=lambda c: c.strategy.cp > 1 and c.strategy.cp_balance
         and c.strategy.cp_attention != "alltoall"),
    Pass("autodiff", _autodiff, F({"valid_strategy", "casts", "sequence_order"}),
         F({"train_step"})),
    Pass("expert_load", _expert_load, F({"train_step"}), F({"expert_reports"}),
         when=lambda c: bool(moe_blocks(c.graph))),
    Pass("resolve_derived", _resolve_derived, F({"valid_strategy", "train_step"}),
         F({"concrete_strategy"})),
    Pass("expand_batch_norm", _expand_batch_norm, F({"train_step", "concrete_strategy"}),
         F({"batch_sums"}), when=lambda c: c.strategy.dp > 1),
    Pass("expand_log_softmax", _expand_log_softmax, F({"train_step", "concrete_strategy"}),
         F({"class_sums"}), when=_vocab_tp),
    Pass("assign_stages", _assign_stages, F({"concrete_strategy", "batch_sums", "class_sums"}),
         F({"stages"})),
    Pass("share_params", _share_params, F({"stages"}), F({"stage_copies"})),
    Pass("split_norm", _split_norm, F({"stage_copies"}), F({"norm_parts"}),
         when=lambda c: c.strategy.pp > 1),
    Pass("tensor_parallel", _tensor_parallel,
         F({"concrete_strategy", "stage_copies", "norm_parts"}),
         F({"param_layouts"})),
    Pass("expert_parallel", _expert_parallel, F({"concrete_strategy", "stage_copies"}),
         F({"expert_layouts"}), when=lambda c: c.strategy.ep > 1),
    Pass("propagate_sbp", _propagate_sbp,
         F({"stages", "stage_copies", "param_layouts", "expert_layouts"}), F({"sbp"})),
    Pass("context_parallel", _context_parallel, F({"sbp"}), F({"attention_split"}),
         when=lambda c: c.strategy.cp > 1),
    Pass("add_boxing", _add_boxing, F({"sbp", "attention_split"}), F({"boxed"})),
    Pass("recompute", _recompute, F({"boxed"}), F({"recompute_clones"}),
         when=lambda c: c.strategy.recompute != Recompute.NONE),
    Pass("split_backward", _split_backward, F({"boxed", "recompute_clones"}),
         F({"weight_split"}), when=lambda c: splits_backward(c.strategy)),
    Pass("kernel_temps", _kernel_temps, F({"boxed", "recompute_clones", "weight_split"}),
         F({"temps"})),
    Pass("make_job", _make_job, F({"boxed", "temps"}), F({"job"})),
], check=_check)

TRAIN_STEP_PASSES = ("apply_precision", "autodiff")  # what a train step made by hand has had


def plan_job(graph: Graph, mesh: Mesh, strategy: Strategy, checks: bool | None = None) -> Job:
    """The Job of `graph` (a train step, precision and autodiff already
    applied) for `strategy` on `mesh`: `PASSES` without those two."""
    c = PASSES.run(Compilation(graph, mesh, strategy), skip=TRAIN_STEP_PASSES, checks=checks)
    return c.job


def plan_forward(graph: Graph, mesh: Mesh, strategy: Strategy,
                 checks: bool | None = None) -> Job:
    """The forward-only Job of `graph` (a captured forward, ending in its
    loss) for evaluation: `PASSES` without autodiff, so it has no backward,
    no gradient and no optimizer op. Its ranks run F actions only (the
    schedule's B actions and STEP find nothing to do), each micro-batch's
    loss on the last stage, with the train Job's placement, layouts and
    stages, so an evaluating rank reads the parameters the train plan keeps.
    Dropout is off, as in `module.eval()` (`eval_mode.py`)."""
    c = PASSES.run(Compilation(eval_mode(graph), mesh, strategy), skip=("autodiff",),
                   checks=checks)
    return c.job
