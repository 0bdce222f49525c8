"""The device mesh, the parallel strategy and where each stage's ranks live.

Invariants:
- `world = nodes * devices_per_node = dp * tp * pp`.
- Stage `s` owns ranks `stage_ranks[s]`, laid out as a `(dp, tp)` grid, tp
  innermost: rank of grid coordinate `(d, t)` is `stage_ranks[s][d * tp + t]`.
  By default stage `s` owns the contiguous block `[s*dp*tp, (s+1)*dp*tp)`,
  so a tp group stays inside one node whenever `tp <= devices_per_node`.
- Plain data: validation with user-facing errors lives in `passes/strategy.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp", "tp")  # names of the placement grid's axes, outermost first


@dataclass(frozen=True, slots=True)
class Mesh:
    nodes: int = 1
    devices_per_node: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node


@dataclass(frozen=True, slots=True)
class Placement:
    """The ranks of one stage as a grid (outermost axis first, row-major)."""

    ranks: tuple[int, ...]
    grid: tuple[int, ...]

    def coord(self, rank: int) -> tuple[int, ...]:
        i = self.ranks.index(rank)
        out = []
        for n in reversed(self.grid):
            i, c = divmod(i, n)
            out.append(c)
        return tuple(reversed(out))

    def rank_at(self, coord: tuple[int, ...]) -> int:
        i = 0
        for c, n in zip(coord, self.grid):
            i = i * n + c
        return self.ranks[i]


@dataclass(frozen=True, slots=True)
class Strategy:
    """How to parallelize: Megatron's names and meanings."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    global_batch_size: int = 1
    micro_batch_size: int = 1
    schedule: str = "1f1b"           # gpipe | 1f1b | interleaved
    layer_pattern: str = ""          # regex over module paths; "" = the model's; "auto"
    layer_stages: tuple[int, ...] = ()   # optional user stage per layer
    stage_ranks: tuple[tuple[int, ...], ...] = ()  # optional explicit ranks per stage
    tp_plan: tuple[tuple[str, str], ...] | str = ()  # (module-path regex, style), or "auto"
    precision: str = "fp32"          # fp32 | bf16 | fp16 (mixed, fp32 master weights)
    recompute: str = "none"          # none | full | selective (activation checkpointing)
    recompute_pattern: str = ""      # regex of checkpointed regions; "" = the layer pattern
    initial_loss_scale: float = 65536.0  # fp16 dynamic loss scaling starts here

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def grid(self) -> tuple[int, int]:
        return (self.dp, self.tp)

    def ranks_of_stage(self, stage: int) -> tuple[int, ...]:
        if self.stage_ranks:
            return self.stage_ranks[stage]
        n = self.dp * self.tp
        return tuple(range(stage * n, (stage + 1) * n))

    def placement(self, stage: int) -> Placement:
        """Stage `stage`'s ranks as a (dp, tp) grid."""
        return Placement(self.ranks_of_stage(stage), (self.dp, self.tp))

    def stage_of_rank(self, rank: int) -> int:
        for s in range(self.pp):
            if rank in self.ranks_of_stage(s):
                return s
        raise ValueError(f"rank {rank} is in no stage")
