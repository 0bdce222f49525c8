"""The executor of one rank: runs a RankPlan's actions with torch kernels.

Invariants:
- Load time does all the work that can be done once: each action template
  (chunk x phase, and the STEP) becomes one straight-line function
  (`codegen`), with this rank's variants and collectives bound (`bind`);
  send/recv pieces are resolved to slices. The step loop only dispatches.
- Per micro-batch an environment holds the values that live between
  actions; a value leaves it after the last action that needs it. State
  (parameters, buffers, gradient accumulators, optimizer slots) lives in one
  dict by name; buffer and accumulator updates apply after each action,
  parameter and optimizer updates after the STEP.
- Sends are asynchronous (waited at the end of the step), receives are
  waited before the action that needs them: the checker's simulation uses
  the same semantics, so a plan it proves deadlock-free runs. An all-reduce
  whose result no op reads (the loss's) is waited at the end of the step
  too (`bind.deferred_all_reduce`); one of a value made from the data
  alone (cross-entropy's count of targets) starts first in its task group
  and is waited where it stands (`early_collectives.py`).
- With one rank and no process group this is the single-process executor.
- Gradient buckets (`grad_buckets.py`, not for fp16): the STEP's reductions
  over dp start during the last micro-batch's backward, coalesced, in the
  background; the STEP waits for them. At ZeRO 2 and 3 each micro-batch's
  gradient reduce-scatters do the same within the backward, and run, with
  the accumulation of their results, once the next bucket has started
  (the plan's `run_ids`, `buckets.run_order`); at ZeRO 1 and 2 the STEP's all-gathers of updated
  parameter shards too. ZeRO-3's parameter gathers start one layer ahead,
  a layer's as one collective (`gather_prefetch.py`).
- On a GPU, each micro-batch's inputs are sliced on the host, pinned and
  copied asynchronously (the compute stream orders the copy before use);
  the plan must have been lowered for the device's type (its kernels).
- fp16: before the STEP every rank divides its gradient accumulators by the
  loss scale and checks them for inf/nan; one all-reduce (max) of that flag
  over the whole world makes every rank skip, or take, the same step, and
  every rank moves its own copy of the scale the same way (`amp.py`), as
  GradScaler does.
- The guard (`--on-nonfinite`, with the gradient norm in the plan): right
  after `clip_coef` the STEP reads the norm, the same on every rank; if it
  is inf or nan no rank runs the rest of the STEP (no update, no ZeRO
  gather), and `halt` raises `NonFiniteNorm` while `skip` goes on.
- With `spans` set to a list, a step appends one `Span` per action (and one
  for waiting on the sends) in `time.perf_counter()` seconds; tracing costs
  two clock reads per action (and, on a GPU, a synchronize), so it is on
  only for the traced step.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from functools import partial

import torch

from meshplan.errors import ConfigError, KernelFault, TrainingHalted
from meshplan.ir import GRAD_NORM, LOSS_SCALE, LR, STEP_COUNT, Role
from meshplan.ir.choices import Kernels, Precision, choose
from meshplan.ir.job import Job, StageView
from meshplan.ir.kinds import ALL_GATHER, ALL_REDUCE, CLIP_COEF
from meshplan.lowering.rankplan import (
    STEP_TEMPLATE,
    RankPlan,
    TaskKind,
    action_templates,
    template_of,
)
from meshplan.runtime.amp import initial_loss_scale, next_scale
from meshplan.runtime.bind import (
    RankContext,
    bind_task,
    deferred_all_reduce,
    gather_into,
    localize,
)
from meshplan.runtime.builds import build_noted
from meshplan.runtime.codegen import compile_segment, failing_ops
from meshplan.runtime.data import data_rows
from meshplan.runtime.early_collectives import EarlyCollectives
from meshplan.runtime.fused import InductorRun
from meshplan.runtime.gather_prefetch import GatherPrefetch
from meshplan.runtime.grad_buckets import GradBuckets
from meshplan.runtime.live_bytes import LiveBytes
from meshplan.runtime.state import sliced_state
from meshplan.runtime.transfers import Transfers
from meshplan.schedules import stage_placement
from meshplan.schedules.action import ActionType
from meshplan.schedules.trace import Span, Track, action_span

_PER_MICROBATCH = (Role.BUFFER, Role.GRAD)


class RankExecutor:
    """Runs `plan` (this rank's part of `job`) step after step, reading only
    its stage's view of the Job (`job` may be that view or the whole Job)."""

    def __init__(self, job: Job | StageView, plan: RankPlan, comm=None, device="cpu",
                 seed: int = 0, kernels: str = "eager"):
        self.plan, self.comm = plan, comm
        self.kernels = choose(Kernels, kernels, "kernels")
        self.device = torch.device(device)
        if plan.device != self.device.type:
            raise ConfigError(f"rank {plan.rank}'s plan was lowered for {plan.device} but "
                              f"runs on {self.device.type}; compile with --device "
                              f"{self.device.type}, or run with --device {plan.device}")
        self.ctx = RankContext(job, plan)
        self.view = view = self.ctx.view
        self.ctx.random.seed = seed
        self.next_step = 0  # the random ops' step: `step` counts it on
        self.mem = LiveBytes()
        self.current = "load"
        self.index = -1  # the action running (its index in the plan)
        self.on_action = None  # called with each action's index (a launcher's watchdog)
        self.spans: list | None = None  # when a list: each action's Span is appended
        values = view.values.values()
        self.names = {v.id: v.name for v in values if v.role not in (Role.INTERNAL, Role.DATA)}
        roles = {v.name: v.role for v in values if v.role is not Role.INTERNAL}
        self.updates = {u: (name, roles.get(name)) for name, u in view.finals.items()}
        self.data_ids = list(view.data)  # a batch's tensors, in order
        self.grad_names = [v.name for v in view.inputs_by_role(Role.GRAD)]
        train = view.facts.train
        self.trains = train is not None  # a forward-only Job (evaluation) has no STEP work
        self.placement = stage_placement(view.strategy)
        self.fp16 = view.strategy.precision == Precision.FP16
        self.loss_scale, self.good_steps, self.skipped = initial_loss_scale(view.facts), 0, 0
        self.clips = any(v.name == GRAD_NORM for v in view.inputs_by_role(Role.OPT_STATE))
        self.schedule = train.lr_schedule if train else None
        self.guard = train.on_nonfinite if train else None  # halt | skip | None (no norm)
        self.nonfinite: float | None = None  # the last step's norm, when not finite
        self.step_losses: dict = {}  # this step's losses so far (a halt reports them)
        # the graph's reports this rank makes, and this step's sums of them
        self.reports = dict(view.reports)
        self.report_ids = frozenset(self.reports.values())
        self.step_reports: dict[str, torch.Tensor] = {}
        self._reported: set[tuple[str, int]] = set()
        self.in_place: dict[int, str] = {}  # STEP gathers written into their state (`_into`)
        self._state: dict = {}  # the state of the step running
        self.buckets = GradBuckets(plan.buckets, self.ctx, comm, self.mem) \
            if comm is not None and plan.buckets else None
        self.run_at = {i: k for k, i in enumerate(plan.run_ids)} if self.buckets else {}
        self.prefetch = GatherPrefetch(plan, self.ctx, comm, self.names) \
            if comm is not None and view.strategy.zero.regathers else None
        self._build(plan)
        self.rows = data_rows(self.ctx, [v for v in self.data_ids if v in self.used])
        self.transfers = Transfers(plan, self.ctx, self.device,
                                   p2p=getattr(comm, "p2p", None))
        self.next_recv = _next_recv(plan.actions)

    # ------------------------------------------------------------ load time
    def _build(self, plan: RankPlan) -> None:
        g, view = self.view.op_of, self.view
        by_tmpl = defaultdict(list)
        for t in plan.tasks:
            if t.kind not in (TaskKind.SEND, TaskKind.RECV):
                by_tmpl[template_of(t)].append(t)
        # Who uses each per-micro-batch value after it is made: the task
        # groups that read it, and the SEND actions that send it. The order
        # of a micro-batch's groups is the schedule's (a W may run before or
        # after another chunk's I), so a value leaves its micro-batch's env
        # when its last user has run, counted down at run time.
        made_in: dict[int, tuple] = {}
        users: dict[int, set] = defaultdict(set)
        for key, tasks in by_tmpl.items():
            for t in tasks:
                op = g[t.op]
                made_in.update((o, key) for o in op.outputs if o >= 0)
        for key, tasks in by_tmpl.items():
            if key == STEP_TEMPLATE:
                continue
            for t in tasks:
                for r in g[t.op].refs():
                    if r not in self.names and made_in.get(r) != key:
                        users[r].add(key)
        for t in plan.tasks:
            if t.kind is TaskKind.SEND:
                users[g[t.op].args[0].id].add(  # one SEND action per receiving stage
                    ("send", t.chunk, t.phase, view.op_stage[t.op], view.op_chunk[t.op]))
        self.uses = {v: len(u) for v, u in users.items()}
        self.used = set(users)
        read = {r for op in view.ops for r in op.refs()} | set(self.updates)  # a state, too
        self.deferred = {t.op for t in plan.tasks if self.comm is not None and len(t.group) > 1
                         and t.kind is TaskKind.COLLECTIVE and g[t.op].kind == ALL_REDUCE
                         and not read.intersection(g[t.op].outputs)}
        self.pending: list = []  # the deferred all-reduces' work, waited at the step's end
        self.early = EarlyCollectives(self.view, self.comm)
        self.segments = {key: self._segment(key, tasks) for key, tasks in by_tmpl.items()}

    def _segment(self, key, tasks):
        g, loss = self.view.op_of, self.view.loss
        if self.run_at:  # per-micro-batch reductions after their bucket starts
            tasks = sorted(tasks, key=lambda t: self.run_at[t.id])
        hooks = self.buckets.hooks(key) if self.buckets else {}
        if self.guard is not None and key == STEP_TEMPLATE:  # a non-finite norm: no update
            for t in tasks:
                if g[t.op].kind == CLIP_COEF:
                    assert t.op not in hooks
                    hooks[t.op] = (_finite_norm, [g[t.op].outputs[0]])
        early: dict = {}
        if self.comm is not None:  # the data's own all-reduces, started first
            tasks, early_hooks, early = self.early.order(tasks)
            assert not set(hooks) & set(early_hooks)
            hooks |= early_hooks
        ops = [localize(g[t.op], self.ctx) for t in tasks]
        if self.buckets is not None:
            ops = [self.buckets.segment_op(op) for op in ops]
        produced = {o for op in ops for o in op.outputs if o >= 0}
        reads = list(dict.fromkeys(r for op in ops for r in op.refs() if r not in produced))
        keeps = [o for o in produced if o in self.uses or o in self.updates or o == loss
                 or o in self.report_ids]
        shared = [r for r in reads if self.uses.get(r, 0) > 1]  # others read it too
        if key == STEP_TEMPLATE and self.comm is not None:
            self.in_place = self._gathered_in_place(ops)
        kernels = {}
        for t in tasks:
            k = (early.get(t.op) or
                 t.op in self.deferred and deferred_all_reduce(t, self.ctx, self.comm,
                                                               self.pending) or
                 self.buckets and self.buckets.kernel(g[t.op]) or
                 self.prefetch and self.prefetch.kernel(t) or
                 g[t.op].outputs[0] in self.in_place and len(t.group) > 1 and
                 gather_into(t, self.ctx, self.comm, partial(self._into, g[t.op].outputs[0])) or
                 bind_task(t, self.ctx, self.comm))
            if k is not None:
                kernels[t.op] = k
        state_reads = [(r, self.names[r]) for r in reads if r in self.names]
        state_reads += [(r, self.updates[r][0]) for r in reads
                        if r in self.updates and r not in self.names and key == STEP_TEMPLATE]
        name = "step" if key == STEP_TEMPLATE else f"chunk{key[0]}_{key[1].value}"
        fuse = (lambda run, ins, outs, label: InductorRun(run, ins, outs, self.device, label,
                                                          self.mem, self._built,
                                                          self._rehearsing)) \
            if self.kernels == "inductor" else None
        fn = compile_segment(ops, reads=reads, keeps=keeps + shared, device=self.device,
                             name=name, kernels=kernels, borrowed=[r for r, _ in state_reads],
                             hooks=hooks, fuse=fuse)
        mb_updates = [(o, n) for o in keeps if o in self.updates
                      for n, role in [self.updates[o]] if role in _PER_MICROBATCH]
        step_updates = [(o, n) for o in keeps if o in self.updates
                        for n, role in [self.updates[o]] if role not in _PER_MICROBATCH]
        return fn, state_reads, mb_updates, step_updates, shared

    def _rehearsing(self) -> bool:
        """The job's first step runs its Inductor runs with eager kernels and
        notes their variants (`InductorRun._rehearse`), built before the next
        step: every rank builds at once, and a run's numbers do not depend on
        whether this machine's cache held it (a resumed run calls no step 0)."""
        return self.ctx.random.step == 0

    def _build_noted(self) -> None:
        runs = [run for seg in self.segments.values() for run in seg[0].runs]
        if any(run.noted for run in runs):
            self.current = "build kernels"
            # the ranks of this machine: torchrun's count, else every rank (launched here)
            local = int(os.environ.get("LOCAL_WORLD_SIZE") or self.view.mesh.world)
            build_noted(runs, self._built, local)

    def _built(self) -> None:
        """A run built or loaded (a cold cache's second step spends minutes
        building): progress, as an action's start is."""
        if self.on_action is not None:
            self.on_action(self.index)

    def _gathered_in_place(self, ops) -> dict[int, str]:
        """The STEP's all-gathers of updated state (ZeRO 1 and 2's parameters)
        that may write into the state's own tensor: no later op of the STEP
        reads its old value. Value id -> state name."""
        old = {name: vid for vid, name in self.names.items()}
        out = {}
        for i, op in enumerate(ops):
            new = op.outputs[0] if op.kind == ALL_GATHER else None
            if new not in self.updates:
                continue
            name = self.updates[new][0]
            if not any(old.get(name) in later.refs() for later in ops[i + 1:]):
                out[new] = name
        return out

    def _into(self, vid: int):
        """Where gathered value `vid` is written: its state's tensor of the
        step running, if `_gathered_in_place` allows (`comm.into_place` takes
        it only if shape and dtype fit), else None."""
        name = self.in_place.get(vid)
        return None if name is None else self._state.get(name)

    # ------------------------------------------------------------ state
    def init_state(self, module) -> dict:
        """This rank's slice of the module's own parameters and buffers; fresh
        optimizer slots; no gradients."""
        used = {b.value for b in self.plan.buffers}
        kept = ({LOSS_SCALE} if self.fp16 else set()) | \
            ({LR, STEP_COUNT} if self.schedule else set())
        # every rank keeps (and checkpoints) the loss scale and the schedule's position
        # (`ir.graph.RANK_WIDE`: in every stage's view)
        used |= {v.id for v in self.view.inputs_by_role(Role.OPT_STATE) if v.name in kept}
        state = sliced_state(self.ctx, module, self.device, used)
        for t in state.values():
            self.mem.add(t)
        return state

    # ------------------------------------------------------------ the step
    def step(self, state: dict, microbatches, local_rows: bool = False) -> list[torch.Tensor]:
        """Run the rank's actions over `microbatches` (global micro-batches,
        or with `local_rows` only this rank's `rows` of each: a reader that
        reads no more than the rank needs) as step `next_step` (the random
        ops' step; a resumed run sets it); returns this rank's loss per
        micro-batch (empty if it holds none)."""
        self.ctx.random.step = self.next_step
        self.next_step += 1
        if self.kernels == "inductor" and not self._rehearsing():
            self._build_noted()  # what step 0 rehearsed, before this step loads it
        for name in self.grad_names:
            self._swap(state, name, None)
        if LOSS_SCALE in state:  # the state is the truth: a checkpoint may have set it
            self.loss_scale = float(state[LOSS_SCALE])
        envs = [self._data_env(mb, local_rows) for mb in microbatches]
        self.nonfinite = None
        self.left: list[dict[int, int]] = [{} for _ in microbatches]
        self._state = state
        if self.buckets is not None:
            self.buckets.start_step(len(envs), self._into)
        if self.prefetch is not None:
            self.prefetch.start_step(state)
        losses: dict[int, torch.Tensor] = {}
        self.step_losses = losses
        self.step_reports, self._reported = {}, set()
        for index, action in enumerate(self.plan.actions):
            self.current, self.index = str(action), index
            if self.on_action is not None:
                self.on_action(index)
            t0 = time.perf_counter()
            ahead = self.next_recv[index]
            if ahead is not None:  # post the next receive while this action runs
                self.transfers.post_recv(self.plan.actions[ahead])
            self._action(action, envs, state, losses)
            if self.spans is not None:
                self._sync()
                self.spans.append(action_span(action, t0, time.perf_counter()))
        self.current = "wait sends"
        t0 = time.perf_counter()
        self.transfers.wait_sends()
        for work in self.pending:
            work.wait()
        self.pending.clear()
        if self.buckets is not None:
            self.buckets.end_step()
        if self.spans is not None:
            self.spans.append(Span("wait sends", Track.COMM, t0, time.perf_counter()))
        self.current = "done"
        return [losses[k] for k in sorted(losses)]

    def kernel_compile(self) -> tuple[float, list[str]]:
        """(seconds of the Inductor runs' first calls, notes of runs it refused)."""
        runs = [run for seg in self.segments.values() for run in seg[0].runs]
        return sum(r.compile_s for r in runs), [r.note for r in runs if r.note]

    def grad_norm(self, state: dict) -> float | None:
        """The last step's global gradient norm (clipping on), else None."""
        return float(state[GRAD_NORM]) if self.clips and GRAD_NORM in state else None

    def _sync(self) -> None:
        """Traced steps on a GPU: wait for the action's kernels, so its span
        is its time on the device, not the time to queue it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _unscale(self, state: dict) -> bool:
        """fp16: unscale this rank's gradients; True if no rank overflowed."""
        names = [n for n in self.grad_names if state.get(n) is not None]
        grads = [state[n] * (1.0 / self.loss_scale) for n in names]  # fresh: adopted
        found = torch.zeros(1, device=self.device)                   # grads are shared
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found, torch.ones(1, device=self.device))
        if self.comm is not None:
            self.comm.all_reduce_world(found, "max")
        for n, g in zip(names, grads):
            self.mem.add(g)
            self._swap(state, n, g)
        overflow = bool(found.item())
        self.skipped += overflow
        self.loss_scale, self.good_steps = next_scale(self.loss_scale, self.good_steps, overflow)
        if LOSS_SCALE in state:
            state[LOSS_SCALE].fill_(self.loss_scale)
        return not overflow

    def _action(self, action, envs: list[dict], state: dict, losses: dict) -> None:
        t = action.type
        if t is ActionType.STEP:
            if not self.trains:
                return
            if self.schedule is not None:
                schedule, base = self.schedule
                state[LR].fill_(schedule.lr_at(base, int(state[STEP_COUNT])))
            if not self.fp16 or self._unscale(state):
                self._guarded_step(state)
            elif self.clips:  # skipped for an overflow: the norm is not finite
                state[GRAD_NORM] = torch.tensor(float("inf"))
            if self.schedule is not None:  # a skipped step moves the schedule too, as torch's
                state[STEP_COUNT] += 1
        elif t.is_compute:
            env, left = envs[action.microbatch], self.left[action.microbatch]
            self.ctx.random.microbatch = action.microbatch
            for key in action_templates(action, self.placement):
                self._run(key, env, state, left)
            if self.view.loss in env and action.microbatch not in losses:
                losses[action.microbatch] = env[self.view.loss].detach()
            for name, vid in self.reports.items():
                if vid in env and (name, action.microbatch) not in self._reported:
                    self._reported.add((name, action.microbatch))
                    got = env[vid].detach()
                    was = self.step_reports.get(name)
                    self.step_reports[name] = got if was is None else was + got
        elif t in (ActionType.SEND_F, ActionType.SEND_B):
            env, left = envs[action.microbatch], self.left[action.microbatch]
            for vid in self.transfers.send(action, env):
                self._release(env, left, vid)
        else:
            self.transfers.recv(action, envs[action.microbatch], self.mem)

    def _guarded_step(self, state: dict) -> None:
        """The STEP; a non-finite gradient norm (every rank has the same)
        stops it before any update, on every rank alike: `halt` raises
        `NonFiniteNorm`, `skip` goes on with the state as it was."""
        try:
            self._run(STEP_TEMPLATE, {}, state)
        except NonFiniteNorm as e:
            self.nonfinite = e.norm
            state[GRAD_NORM] = torch.tensor(e.norm)
            if self.guard == "halt":
                raise

    def _run(self, key, env: dict, state: dict, left: dict | None = None) -> None:
        seg = self.segments.get(key)
        if seg is None:
            return
        fn, state_reads, mb_updates, step_updates, shared = seg
        if self.buckets is not None:
            self.buckets.ran(key)
        for vid, name in state_reads:
            env[vid] = state[name]
        try:
            fn(env, self.mem)
        except (RuntimeError, IndexError) as err:  # embedding's out of range is an IndexError
            raise _kernel_error(self.view, failing_ops(fn, err), err, self.device) from err
        for vid, name in mb_updates + step_updates:
            self._swap(state, name, env.pop(vid))
        for vid, _ in state_reads:
            env.pop(vid, None)
        for vid in shared:
            self._release(env, left, vid)

    def _release(self, env: dict, left: dict, vid: int) -> None:
        """One user of `vid` in this micro-batch is done (`left` counts the
        users still to come); the last one drops it."""
        n = left.pop(vid, self.uses[vid]) - 1
        if n > 0:
            left[vid] = n
        elif vid in env:
            self.mem.drop(env.pop(vid))

    def _data_env(self, batch, local_rows: bool = False) -> dict:
        env = {}
        for vid, t in zip(self.data_ids, batch):
            if vid not in self.used:
                continue
            box = self.ctx.box(vid)
            if local_rows:  # dim 0 holds this rank's rows only
                assert self.rows is not None and t.shape[0] == self.rows[1] - self.rows[0]
                box = ((box[0][0] - self.rows[0], box[0][1] - self.rows[0]),) + tuple(box[1:])
            local = t
            for d, (a, b) in enumerate(box):
                if (a, b) != (0, t.shape[d]):
                    local = local.narrow(d, a, b - a)
            if self.device.type == "cuda":  # pinned host memory: an asynchronous copy
                local = local.contiguous().pin_memory().to(self.device, non_blocking=True)
            else:
                local = local.to(self.device)
            env[vid] = local
            self.mem.add(local)
        return env

    def _swap(self, state: dict, name: str, new) -> None:
        old = state.get(name)
        state[name] = new
        self.mem.drop(old)


class NonFiniteNorm(Exception):
    """The step's gradient norm is inf or nan (the guard, `--on-nonfinite`)."""

    def __init__(self, norm: float):
        super().__init__(f"the gradient norm is {norm}")
        self.norm = norm


def halted(step: int, err: NonFiniteNorm, losses) -> TrainingHalted:
    """The one line a run stopped by the guard ends with."""
    loss = [float(x) for x in losses]
    bad_loss = any(not math.isfinite(x) for x in loss)
    what = (f"the loss is {loss[0]} and " if bad_loss else "") + str(err)
    return TrainingHalted(f"step {step}: {what}; stopped before applying it "
                          "(--on-nonfinite halt; no checkpoint written): lower the learning "
                          "rate, or pass --on-nonfinite skip to skip such steps")


def _finite_norm(values) -> None:
    """The guard's hook, right after `clip_coef`: before any optimizer op."""
    norm = float(values[0])  # a sync on a GPU, as GradScaler's found-inf check
    if not math.isfinite(norm):
        raise NonFiniteNorm(norm)


def _next_recv(actions) -> list[int | None]:
    """For each action index, the index of the first RECV action after it."""
    out: list[int | None] = [None] * len(actions)
    nxt = None
    for i in range(len(actions) - 1, -1, -1):
        out[i] = nxt
        if actions[i].type in (ActionType.RECV_F, ActionType.RECV_B):
            nxt = i
    return out


_LOW_DTYPE_ERRORS = ("not implemented for 'Half'", "Unsupported dtype Half",
                     "Low precision dtypes not supported", "not implemented for 'BFloat16'")
# A kernel refusing its input's values: the data or the model's config is at fault
_INPUT_ERRORS = ("out of bounds", "out of range", "index ", "Target ", "must be in range")
# A scalar the model writes into a low-precision tensor that cannot hold it (DeBERTa's
# `masked_fill(m, torch.finfo(torch.float32).min)` on bf16 scores: eager autocast fails alike)
_OVERFLOW = "without overflow"


def _kernel_error(view, ops: tuple[int, ...], err: Exception, device) -> Exception:
    """A kernel's failure, named by op and module, as one line: a missing
    fp16/bf16 kernel is the user's choice of precision, with the fix; an
    index out of range the input's, a scalar a low dtype cannot hold the
    model's (exit 2); anything else meshplan's (exit 1)."""
    if not ops:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        return KernelFault(f"a kernel failed: {text} (rerun with --debug for the "
                           "traceback, and report it)")
    op = view.op_of[ops[0]]
    where = f"{op.kind} at module '{op.module_path}' ({op.source or 'no source'})"
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    if any(m in text for m in _LOW_DTYPE_ERRORS):
        low = "float16" if "Half" in text else "bfloat16"
        other = Precision.BF16 if low == "float16" else Precision.FP32
        return ConfigError(f"{where} has no {low} kernel on {device.type} ({text}); "
                           f"use --precision {other}")
    if _OVERFLOW in text:
        return KernelFault(f"{where} writes a value its tensor's dtype cannot hold ({text}): "
                           "the model's code does not run in this precision (eager "
                           "torch.autocast fails there alike); use --precision fp32", 2)
    if any(m in text for m in _INPUT_ERRORS):
        return KernelFault(f"{where} failed on its input: {text}; check the data and the "
                           "model's config (vocabulary, positions) against each other", 2)
    return KernelFault(f"{where} failed: {text} (meshplan's fault: rerun with --debug for "
                       "the traceback, and report it)")
