"""The search space: every strategy the search may choose, as plain data.

Invariants:
- A `Candidate` fixes dp, tp, pp, vpp, the schedule, the micro-batch size,
  recompute, the ZeRO level, ep, cp and sequence parallelism; its uneven layout (layers per virtual
  stage) is derived by cost when it is priced (`estimate`).
- `candidates` yields only strategies the planner accepts on their face:
  dp * cp * tp * pp = world; tp divides the devices of a node (a tp group never
  leaves one); pp * vpp <= layers; dp divides the global batch, and the
  micro-batch size divides its share; the schedule takes (pp, vpp, M)
  (`schedules.compute_actions` does not refuse it, nor the planner's
  `check_strategy`); ZeRO only with dp > 1; ep > 1 only for a mixture of
  experts, dividing dp and the experts; cp > 1 only when the space has a
  sequence (`search` gives it one when nothing fits without), 2 x cp
  dividing it.
  What only the planner knows (tp dividing the heads and the vocabulary)
  is found by the probe, whose error removes the candidate.
- The order is deterministic, so ties are broken the same way every run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cache

from meshplan.errors import ConfigError, ScheduleError
from meshplan.ir.choices import Recompute
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.ir.zero import ZeroLevel
from meshplan.passes.strategy import check_strategy
from meshplan.schedules import compute_actions, spec_of
from meshplan.schedules.registry import DEFAULT, searched

RECOMPUTE = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
ZERO = tuple(ZeroLevel)
MAX_VPP = 4
MICRO_BATCH_SIZES = (1, 2, 4, 8)  # Megatron's usual sweep


@dataclass(frozen=True, slots=True, order=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    vpp: int
    schedule: str
    micro_batch_size: int
    recompute: str
    zero: ZeroLevel
    ep: int = 1  # of the dp ranks, those the experts split over (Strategy.ep)
    cp: int = 1  # the ranks each sequence is split over (Strategy.cp)
    sp: bool = False  # sequence parallelism over tp (Strategy.sequence_parallel)

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero", ZeroLevel.parse(self.zero))  # frozen

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch_size)

    def label(self) -> str:
        parts = [f"dp{self.dp}"] + ([f"ep{self.ep}"] if self.ep > 1 else []) + \
            ([f"cp{self.cp}"] if self.cp > 1 else []) + [f"tp{self.tp}"] + \
            (["sp"] if self.sp else []) + [f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.pp > 1:
            parts.append(str(self.schedule))
        parts.append(f"mb{self.micro_batch_size}")
        if self.recompute != Recompute.NONE:
            parts.append(f"rc-{self.recompute}")
        if self.zero is not ZeroLevel.NONE:
            parts.append(f"zero{self.zero}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Space:
    """What the search may vary (each a tuple of allowed values; () = all)."""

    schedules: tuple[str, ...] = searched()  # the registry's, in its order
    recompute: tuple[str, ...] = tuple(RECOMPUTE)
    zero: tuple[ZeroLevel, ...] = ZERO
    micro_batch_sizes: tuple[int, ...] = MICRO_BATCH_SIZES
    max_vpp: int = MAX_VPP
    # dp x micro-batch size when a captured graph's batch fixes it (0: free);
    # the micro-batch size is then samples / dp, whatever `micro_batch_sizes`
    samples: int = 0
    # a mixture of experts' experts per block (0: none, ep is 1); ep is then
    # each divisor of dp that divides them, or only those in `eps` when given
    experts: int = 0
    eps: tuple[int, ...] = ()
    # context parallelism: the sequence's length (0: cp is 1); cp is then each
    # divisor of the ranks left that 2 x cp divides it by, or only those in `cps`
    seq: int = 0
    cps: tuple[int, ...] = ()
    # sequence parallelism with tp > 1: each of these ((False, True): both,
    # a candidate with it first bounded by its twin without; (True,): only
    # candidates with it, so tp > 1, `--sequence-parallel --auto`); ():
    # as the sequence says (`search.search`: both for a long one, else
    # without, and both when nothing fits without); a model without a
    # sequence never has it
    sps: tuple[bool, ...] = ()


def candidates(mesh: Mesh, layers: int, global_batch: int,
               space: Space | None = None) -> Iterator[Candidate]:
    space = space or Space()
    if not space.sps:  # as the sequence says: `search` resolves it; here, without
        space = replace(space, sps=(False,))
    world = mesh.world
    for tp in _divisors(mesh.devices_per_node):
        if world % tp:
            continue
        for pp, cp in ((p, c) for p in _divisors(world // tp)
                       for c in _cps(world // (tp * p), space)):
            if pp > layers:
                continue
            dp = world // (tp * pp * cp)
            if global_batch % dp or (space.samples and space.samples % dp):
                continue
            sizes = ([space.samples // dp] if space.samples else
                     _micro_batches(global_batch // dp, space.micro_batch_sizes))
            for mbs in sizes:
                if global_batch % (dp * mbs):
                    continue
                m = global_batch // (dp * mbs)
                for schedule, vpp in _schedules(pp, m, layers, space):
                    for ep in _eps(dp, space):
                        if not _planner_takes(mesh, dp, tp, pp, vpp, schedule, global_batch,
                                              mbs, ep, cp):
                            continue
                        for rc in space.recompute:
                            for z in space.zero if dp > 1 else (ZeroLevel.NONE,):
                                for sp in space.sps if tp > 1 else _no_sp(space):
                                    yield Candidate(dp, tp, pp, vpp, schedule, mbs, str(rc),
                                                    z, ep, cp, sp)


def _no_sp(space: Space) -> tuple[bool, ...]:
    """tp = 1 has no sequence parallelism: allowed only where the space allows
    candidates without (`--sequence-parallel --auto` fixes it on: tp > 1)."""
    return (False,) if False in space.sps else ()


def _cps(ranks: int, space: Space) -> list[int]:
    """The context-parallel degrees to try with `ranks` left for dp x cp: 1,
    or with a sequence each divisor that splits it into 2 x cp chunks."""
    if not space.seq:
        return [1]
    return [c for c in _divisors(ranks) if (c == 1 or space.seq % (2 * c) == 0) and
            (not space.cps or c in space.cps)]


def _eps(dp: int, space: Space) -> list[int]:
    """The expert-parallel degrees to try at `dp`: 1, or with experts each
    divisor of dp that divides them (and is allowed)."""
    if not space.experts:
        return [1]
    return [e for e in _divisors(dp) if space.experts % e == 0 and
            (not space.eps or e in space.eps)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(share: int, allowed: Sequence[int]) -> list[int]:
    return [b for b in _divisors(share) if b in allowed]


def _schedules(pp: int, m: int, layers: int, space: Space) -> Iterator[tuple[str, int]]:
    """(schedule, vpp) pairs to try: at one stage only the default (every
    schedule degenerates there); else each schedule at the vpps its record
    lets the search try."""
    if pp == 1:
        yield DEFAULT, 1
        return
    for schedule in space.schedules:
        for vpp in spec_of(schedule).vpps_to_search(space.max_vpp):
            if pp * vpp <= layers and schedule_takes(schedule, pp, vpp, m):
                yield schedule, vpp


@cache
def schedule_takes(schedule: str, pp: int, vpp: int, m: int) -> bool:
    """Whether `schedule` has an order for (pp, vpp, m)."""
    try:
        compute_actions(schedule, pp, vpp, m, 0)
    except ScheduleError:
        return False
    return True


@cache
def _planner_takes(mesh: Mesh, dp: int, tp: int, pp: int, vpp: int, schedule: str,
                   global_batch: int, mbs: int, ep: int = 1, cp: int = 1) -> bool:
    """Whether the planner's own strategy check (`passes/strategy.py`) accepts it."""
    try:
        check_strategy(mesh, Strategy(dp=dp, tp=tp, pp=pp, vpp=vpp, schedule=schedule,
                                      global_batch_size=global_batch, micro_batch_size=mbs,
                                      ep=ep, cp=cp))
    except (ConfigError, ScheduleError):
        return False
    return True
