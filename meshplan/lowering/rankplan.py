"""RankPlan: everything one rank executes, and nothing any other rank does.

Invariants:
- Tasks are static: each runs once per micro-batch (forward, backward,
  weight phase) or once per step (optimizer phase), as the rank's `actions`
  order them. An action on virtual stage `v` runs, in order, the tasks of
  `v`'s chunk (its place in `schedules.stage_placement`) that
  `action_templates` names: F the forward ones; I the backward ones (the
  input gradients); W the weight phase's (weight gradients, only in a Job
  for a zero-bubble schedule); B both, I then W; `STEP` the
  optimizer-phase tasks. SEND/RECV actions run the send/recv tasks of that
  virtual stage.
- Buffers hold physical (local) shapes, derived from the logical shape and
  the N-D SBP at the rank's grid coordinate. `copies` is how many
  micro-batches' instances can be alive at once.
- Ids: tasks per `ids.task_id`; buffers, memory blocks and memory arenas
  share the rank's `(rank << ids.LOCAL_BITS) + counter` space.
- Everything the runtime runs is here, lowered once: besides tasks,
  buffers, memory layout and actions, the gradient buckets (`buckets`), the
  task order they imply (`run_ids`) and ZeRO-3's gathers by layer
  (`gathers`); a rank's stage and grid coordinate.
- The plan is a pure function of (Job, rank, device type): its bytes are
  the same in whatever process computes it. The device type picks physical
  kernels (`Task.kernel`, from the op rule table's per-device choosers); the
  Job itself names only logical ops.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass

from meshplan.ir import DType, Phase
from meshplan.ir.choices import KernelVariant
from meshplan.ir.kinds import ALL_REDUCE
from meshplan.ir.stage_placement import StagePlacement
from meshplan.schedules.action import Action, ActionType

STEP_TEMPLATE = (-1, Phase.OPTIMIZER)
_PHASES = {ActionType.F: (Phase.FORWARD,), ActionType.I: (Phase.BACKWARD,),
           ActionType.W: (Phase.WEIGHT,), ActionType.B: (Phase.BACKWARD, Phase.WEIGHT)}


def template_of(task: Task) -> tuple[int, Phase]:
    """The (chunk, phase) group of tasks that `task` runs in (STEP_TEMPLATE
    for the optimizer's)."""
    return STEP_TEMPLATE if task.phase is Phase.OPTIMIZER else (task.chunk, task.phase)


def action_templates(action: Action, placement: StagePlacement) -> tuple[tuple[int, Phase], ...]:
    """The task groups a compute action or STEP runs, in order; () for SEND/RECV."""
    if action.type is ActionType.STEP:
        return (STEP_TEMPLATE,)
    phases = _PHASES.get(action.type, ())
    chunk = placement.chunk_of(action.virtual_stage) if phases else -1
    return tuple((chunk, ph) for ph in phases)


class TaskKind(enum.Enum):
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    SEND = "send"
    RECV = "recv"
    GRAD_REDUCE = "grad_reduce"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True, slots=True)
class Task:
    """One op of the Job as this rank runs it."""

    id: int
    kind: TaskKind
    op: int                         # the Job op it comes from
    chunk: int
    phase: Phase
    inputs: tuple[int, ...]         # buffer ids, in the op's `refs()` order
    outputs: tuple[int, ...]        # buffer ids (-1: absent output)
    variant: tuple[str, ...] = ()     # rank-dependent kernel variant per mesh axis
    group: tuple[int, ...] = ()     # collective participants, in group order
    peer: int = -1                  # send/recv: the other rank
    peer_task: int = -1             # send/recv: the matching task on the peer
    box: tuple[tuple[int, int], ...] = ()  # send/recv: logical slice moved
    kernel: str = ""                # the device's physical kernel ("" = the op's kind)


@dataclass(frozen=True, slots=True)
class Buffer:
    """A register: one value's local tensor on this rank."""

    id: int
    value: int                      # Job value id
    producers: tuple[int, ...]      # task ids (several recv pieces; none for state)
    consumers: tuple[int, ...]      # task ids
    shape: tuple[int, ...]
    dtype: DType
    nbytes: int
    copies: int
    category: BufferCategory


class BufferCategory(enum.StrEnum):
    """What a buffer holds; state (the first four) lives for the whole run."""

    PARAM = "param"
    BUFFER = "buffer"        # a module buffer (BatchNorm running stats)
    GRAD = "grad"
    OPTIMIZER = "optimizer"
    DATA = "data"            # a micro-batch of a user input
    ACTIVATION = "activation"


STATE_CATEGORIES = (BufferCategory.PARAM, BufferCategory.BUFFER, BufferCategory.GRAD,
                    BufferCategory.OPTIMIZER)


@dataclass(frozen=True, slots=True)
class Block:
    """A buffer's (or a buffer group's) place in a memory arena."""

    id: int
    arena: int                      # memory arena id
    offset: int
    size: int
    buffers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Bucket:
    """Reductions (op ids) carried by one flat collective (`lowering/buckets.py`)."""

    group: tuple[int, ...]
    ops: tuple[int, ...]          # the reductions, in the order their values are made
    sources: tuple[int, ...]      # per reduction: the value it reduces
    after: int                    # the op that makes the last source: the bucket is full
    template: tuple               # the task group that op runs in
    every_run: bool = False       # starts in every run of its group (not the last only)
    kind: str = ALL_REDUCE        # the flat collective: ALL_REDUCE, or ALL_GATHER
    slots: tuple[int, ...] = ()   # per reduction: the accumulate_grad writing its slot, or -1


@dataclass(frozen=True, slots=True)
class MemoryLayout:
    arenas: tuple[tuple[int, str, int], ...]   # (id, name, size)
    blocks: tuple[Block, ...]
    peak: tuple[tuple[str, int], ...]          # category -> bytes, and "total"

    def peak_bytes(self) -> int:
        return dict(self.peak)["total"]


@dataclass(frozen=True, slots=True)
class RankPlan:
    rank: int
    world: int
    stage: int
    coord: tuple[int, ...]
    job_digest: str
    tasks: tuple[Task, ...]
    buffers: tuple[Buffer, ...]
    memory: MemoryLayout
    actions: tuple[Action, ...]
    device: str = "cpu"             # the device type it was lowered for (cpu | cuda)
    buckets: tuple[Bucket, ...] = ()  # gradient buckets (`lowering/buckets.py`); () when off
    # task ids in the order the runtime runs them, where buckets move tasks
    # (`buckets.run_order`); (): the order of `tasks`
    run_ids: tuple[int, ...] = ()
    # ZeRO-3's gathers prefetched a layer ahead (`lowering/prefetch.py`): per
    # task group (chunk, phase), the gather ops of each layer in order
    gathers: tuple[tuple[tuple[int, Phase], tuple[tuple[int, ...], ...]], ...] = ()

    def kernel_of(self, task: Task, graph) -> str:
        """The kernel `task` runs: its device kernel, else its op's kind."""
        return task.kernel or graph.ops[task.op].kind


IN_KERNEL = (KernelVariant.RING, KernelVariant.EXPERTS)  # kernels that communicate


def line_axis(variant: tuple[str, ...]) -> int | None:
    """The mesh axis along whose line a task communicates inside its kernel:
    a ring attention's blocks (RING), routed experts' rows (EXPERTS). Its
    group is that line, and its order among the group's collectives is
    proven as theirs (`expand_collectives`)."""
    return next((a for a, v in enumerate(variant) if v in IN_KERNEL), None)


def joins_group(t: Task) -> bool:
    """Whether task `t` communicates with its group: a collective, a
    gradient reduction, a ring or routed experts."""
    return t.kind in (TaskKind.COLLECTIVE, TaskKind.GRAD_REDUCE) or line_axis(t.variant) is not None


def expand_collectives(p: RankPlan, where: StagePlacement, ops=(),
                       buckets=()) -> dict[tuple, list]:
    """Per group: the (op, micro-batch) collectives this rank joins, in order
    (given the Job's `ops`, a cross-stage all-reduce is named by its
    parameter). A gradient bucket (`buckets.py`) is one collective, named by
    its reductions, where it starts: after the op that completes it, in its
    task group's last run of the step (a per-micro-batch bucket in every
    run)."""
    carried = {op for b in buckets for op in b.ops}
    by_template = defaultdict(list)
    for t in p.tasks:
        if joins_group(t) and t.op not in carried:
            by_template[template_of(t)].append(t)
    position = {t.op: i for i, t in enumerate(p.tasks)}
    last_run = {key: i for i, a in enumerate(p.actions) for key in action_templates(a, where)}
    seq = defaultdict(list)
    for i, a in enumerate(p.actions):
        for key in action_templates(a, where):
            events = [(position[t.op], 0, t.group,
                       (_instance(ops[t.op]) if ops else t.op, a.microbatch))
                      for t in by_template.get(key, ())]
            events += [(position[b.after], 1, b.group, (("bucket", *b.ops), a.microbatch))
                       for b in buckets if b.template == key
                       and (b.every_run or last_run[key] == i)]
            for *_, group, item in sorted(events, key=lambda e: e[:2]):
                seq[group].append(item)
    return seq


def _instance(op):
    """What names one collective on every member: its op, except for the
    all-reduce across the stages holding copies of a shared parameter, which
    is one op per stage (each on its own stage) and is named by the parameter."""
    kw = dict(op.kwargs)
    return f"{kw['param']}@copies" if "stages" in kw else op.id
