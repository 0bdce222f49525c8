"""Which pipeline rank runs each virtual stage: data derived from the schedule.

Invariants:
- A `StagePlacement` lists the rank of every virtual stage 0..pp*vpp-1;
  each rank holds exactly vpp stages, and its chunk c is its c-th stage in
  ascending order (the order its layers come in the model).
- Interleaved (the default, torch's "loop" style and Paddle's): stage
  `chunk * pp + rank`, so rank r holds r, r+pp, r+2pp, ...
- V (`zbv`, vpp = 2): rank r holds stages r and 2*pp-1-r, so the model goes
  down the ranks and back up; stages pp-1 and pp share rank pp-1, and the
  last stage is on rank 0, beside the first.

        stage   0  1  2  3 | 4  5  6  7        (pp = 4, vpp = 2)
        V       0  1  2  3 | 3  2  1  0        interleaved  0 1 2 3 | 0 1 2 3

- Which schedule uses which placement is the schedule's record
  (`schedules/registry.py`, `placement_of` there); this module only holds
  the placements, so the Job and the schedules read the same data (a
  schedule read from a CSV carries its own, `placement_read_off`).
- Lives in `ir/` because the Job's layout (`passes/pipeline.py`) and every
  rank (lowering, the runtime) read it: a pipeline stage (a rank's position,
  `Strategy.stage_of_rank`) holds virtual stages `stages_of(stage)`, its
  chunk c being the c-th.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from meshplan.errors import ScheduleError


@dataclass(frozen=True, slots=True)
class StagePlacement:
    """`ranks[stage]` is the rank that runs virtual stage `stage`."""

    pp: int
    ranks: tuple[int, ...]
    # derived once: each rank's stages, and each stage's chunk (hot in lowering and search)
    by_rank: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    chunks: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        held = [self.ranks.count(r) for r in range(self.pp)]
        if not self.ranks or len(set(held)) != 1 or sum(held) != len(self.ranks):
            raise ScheduleError(f"a stage placement gives every rank 0..{self.pp - 1} the same "
                                f"number of stages; got ranks {list(self.ranks)} by stage")
        by_rank = tuple(tuple(s for s, r in enumerate(self.ranks) if r == rank)
                        for rank in range(self.pp))
        object.__setattr__(self, "by_rank", by_rank)
        object.__setattr__(self, "chunks", tuple(by_rank[r].index(s)
                                                 for s, r in enumerate(self.ranks)))

    @staticmethod
    def interleaved(pp: int, vpp: int) -> StagePlacement:
        """Stage `chunk * pp + rank` on `rank` (the default)."""
        return StagePlacement(pp, tuple(s % pp for s in range(pp * vpp)))

    @staticmethod
    def v(pp: int, vpp: int = 2) -> StagePlacement:
        """Rank r holds stages r and 2*pp-1-r; ScheduleError unless vpp == 2."""
        if vpp != 2:
            raise ScheduleError(f"the V placement (schedule zbv) puts two stages on each rank, "
                                f"got vpp={vpp}; use --vpp 2")
        return StagePlacement(pp, tuple(range(pp)) + tuple(reversed(range(pp))))

    @staticmethod
    def covering(pp: int, num_stages: int) -> StagePlacement:
        """The interleaved placement with enough chunks for `num_stages` stages."""
        return StagePlacement.interleaved(pp, max(1, -(-num_stages // pp)))

    @property
    def vpp(self) -> int:
        return len(self.ranks) // self.pp

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    def rank_of(self, stage: int) -> int:
        """The rank that runs `stage` (0 <= stage < num_stages)."""
        return self.ranks[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` runs, chunk 0 first."""
        return self.by_rank[rank]

    def chunk_of(self, stage: int) -> int:
        """The chunk (position among its rank's stages) of virtual stage `stage`."""
        return self.chunks[stage]

    def stage_at(self, rank: int, chunk: int) -> int:
        """The virtual stage that `rank` runs as its chunk `chunk`."""
        return self.by_rank[rank][chunk]

    def same_rank(self, a: int, b: int) -> bool:
        return self.rank_of(a) == self.rank_of(b)


def placement_for(pp: int, num_stages: int,
                  placement: StagePlacement | None) -> StagePlacement:
    """`placement`, checked against pp, or the interleaved one covering `num_stages`."""
    if placement is None:
        return StagePlacement.covering(pp, num_stages)
    if placement.pp != pp or placement.num_stages < num_stages:
        raise ScheduleError(f"stage placement for pp={placement.pp} with "
                            f"{placement.num_stages} stages does not fit pp={pp} with "
                            f"{num_stages} stages; derive it with placement_of(schedule, pp, vpp)")
    return placement


_STAGE = re.compile(r"\d+")


def placement_read_off(pp: int, orders: tuple[tuple[str, ...], ...]) -> StagePlacement:
    """The rank of each stage in `orders` (rank -> actions as text, `2I0`);
    ScheduleError unless each stage has one rank and every rank as many."""
    owner: dict[int, int] = {}
    for rank, order in enumerate(orders):
        for text in order:
            match = _STAGE.match(text)
            if match is None:
                raise ScheduleError(f"rank {rank}'s action {text!r} names no stage; write "
                                    "actions as <stage><F|B|I|W><micro-batch>, e.g. 2I0")
            if owner.setdefault(int(match.group()), rank) != rank:
                raise ScheduleError(f"stage {match.group()} is run by ranks "
                                    f"{owner[int(match.group())]} and {rank}; each stage has "
                                    "one owner rank")
    if sorted(owner) != list(range(len(owner))) or len(orders) != pp:
        raise ScheduleError(f"the schedule's {len(orders)} rows for pp={pp} run stages "
                            f"{sorted(owner)}; give one row per rank, together running "
                            "stages 0..pp*vpp-1")
    return StagePlacement(pp, tuple(owner[s] for s in range(len(owner))))
