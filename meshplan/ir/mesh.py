"""The device mesh, the parallel strategy and where each stage's ranks live.

Invariants:
- `world = nodes * devices_per_node = dp * cp * tp * pp`.
- Stage `s` owns ranks `stage_ranks[s]`, laid out as a `(dp, tp)` grid, tp
  innermost: rank of grid coordinate `(d, t)` is `stage_ranks[s][d * tp + t]`.
- Context parallelism (`cp > 1`) splits each sample's sequence over cp
  ranks, an axis between dp and tp (Megatron's order, tp-cp-dp from the
  inside): the grid is `(dp, cp, tp)`. The weights are replicated over cp;
  the inputs are split by batch over dp and by sequence over cp.
- Expert parallelism (`ep > 1`, Megatron's expert-model-parallel size) is
  carved out of dp, as Megatron and torchtitan carve it: `ep` divides `dp`,
  and the grid is `(dp / ep, ep, tp)`, so the ranks and the data each rank
  reads are those of the plain `(dp, tp)` grid (data-parallel index
  `d * ep + e`). The batch is split over both data axes; an expert weight
  is split over `ep` and replicated over `dp / ep`, the others replicated
  over both (`Strategy.axes` names the axes).
  By default stage `s` owns the contiguous block of its dp * cp * tp ranks,
  so a tp group stays inside one node whenever `tp <= devices_per_node`.
- Plain data. The named choices (precision, recompute, tp styles) become
  `ir/choices` members on construction, and the ZeRO level an
  `ir/zero.ZeroLevel`, so a bad one fails there in one `ConfigError` line;
  every other check lives in `passes/strategy.py`.
- `schedule` is a schedule's name, a record of `schedules/registry.py`
  (which sits above `ir`): its placement, backward split and rules are
  asked there (`schedules.stage_placement(strategy)`), and a bad name
  fails in `check_strategy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.errors import ConfigError
from meshplan.ir.choices import Precision, Recompute, TpStyle, choose
from meshplan.ir.zero import ZeroLevel

AXES = ("dp", "tp")  # the placement grid's axes, outermost first (with ep: `Strategy.axes`)
# attention's forms over cp (`Strategy.cp_attention`; propagate.CP_FORMS keeps each one's)
CP_ATTENTION = ("auto", "allgather", "alltoall", "ring")


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

    ranks: Sequence[int]   # a tuple, or a `range` (`Strategy.ranks_of_stage`)
    grid: tuple[int, ...]

    def coord(self, rank: int) -> tuple[int, ...]:
        i = rank - self.ranks[0]  # the usual contiguous ranks: no search
        if not (0 <= i < len(self.ranks) and self.ranks[i] == rank):
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


# A Strategy's words (docs/architecture.md, Vocabulary): `auto` is only the search
# (`Strategy.auto`); a tp plan or layer pattern read off the module is DERIVED
# (passes/derive.py); layers per virtual stage balanced by cost are BALANCED.
DERIVED = "derived"
BALANCED = "balanced"

@dataclass(frozen=True, slots=True)
class Strategy:
    """How to parallelize: Megatron's names and meanings."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1  # expert parallel, carved out of dp (it divides dp); see the module docstring
    cp: int = 1  # context parallel: the sequence split over cp ranks; see the module docstring
    # with cp > 1, causal attention load-balanced: the sequence reordered so that each
    # rank holds a head and a tail chunk (passes/context_parallel.py); False: in order
    cp_balance: bool = True
    # attention over cp: "allgather" (a rank's query rows against keys and values
    # gathered), "alltoall" (heads or batch split by all-to-all), "auto": the cheaper
    cp_attention: str = "auto"
    global_batch_size: int = 1
    micro_batch_size: int = 1
    schedule: str = "1f1b"          # a name in schedules/registry.py
    layer_pattern: str = ""          # regex over module paths; "" = the model's; DERIVED
    layer_stages: tuple[int, ...] = ()   # optional user stage per layer
    # optional layers per virtual stage (virtual-stage order, pp*vpp entries):
    # an uneven layout; BALANCED: balanced by cost (passes/derive.py)
    stage_layers: tuple[int, ...] | str = ()
    stage_ranks: tuple[tuple[int, ...], ...] = ()  # optional explicit ranks per stage
    tp_plan: tuple[tuple[str, TpStyle], ...] | str = ()  # (module-path regex, style), or DERIVED
    precision: Precision = Precision.FP32
    recompute: Recompute = Recompute.NONE
    recompute_pattern: str = ""      # regex of checkpointed regions; "" = the layer pattern
    # Megatron's sequence parallelism (tp > 1): values between tp blocks split by sequence
    sequence_parallel: bool = False
    initial_loss_scale: float = 65536.0  # fp16 dynamic loss scaling starts here
    # schedule "csv": each pipeline rank's compute actions as text (`2I0`), rank 0 first
    schedule_orders: tuple[tuple[str, ...], ...] = ()
    # sharded data parallel, ZeRO's stages: 1 optimizer state, 2 + gradients, 3 + parameters
    zero: ZeroLevel = ZeroLevel.NONE
    bucket_mb: float = 25.0  # gradient buckets' bound (MiB, DDP's default); 0: none
    # search dp, tp, pp, vpp, schedule, micro-batch, recompute and ZeRO
    # (`api.plan` does, on a device model); the fields above it searches are ignored
    auto: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: parse the names once, here
        set_(self, "precision", choose(Precision, self.precision, "precision"))
        set_(self, "recompute", choose(Recompute, self.recompute, "recompute mode"))
        set_(self, "zero", ZeroLevel.parse(self.zero))
        if isinstance(self.stage_layers, str) and self.stage_layers != BALANCED:
            raise ConfigError(f"stage_layers '{self.stage_layers}' is unknown: give "
                              f"'{BALANCED}' or a layer count per virtual stage, e.g. "
                              "(3, 4, 4, 3)")
        if isinstance(self.tp_plan, str):
            if self.tp_plan != DERIVED:
                raise ConfigError(f"tp_plan '{self.tp_plan}' is unknown: give '{DERIVED}' or a "
                                  "list of (module-path regex, style) pairs, styles "
                                  f"{', '.join(TpStyle)}")
            return
        set_(self, "tp_plan", tuple(
            (pattern, choose(TpStyle, style, "tensor-parallel style", f" for '{pattern}'"))
            for pattern, style in self.tp_plan))

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def grid(self) -> tuple[int, ...]:
        """The placement grid's axis sizes, named by `axes`."""
        sizes = {"dp": self.dp // self.ep, "ep": self.ep, "cp": self.cp, "tp": self.tp}
        return tuple(sizes[a] for a in self.axes)

    @property
    def axes(self) -> tuple[str, ...]:
        """The grid's axis names, outermost first: ("dp", "tp"); with experts
        split "ep" after "dp" (which then counts the expert weights' replicas,
        dp / ep); with the sequence split "cp" before "tp"."""
        return ("dp",) + ("ep",) * (self.ep > 1) + ("cp",) * (self.cp > 1) + ("tp",)

    @property
    def tp_axis(self) -> int:
        return len(self.grid) - 1

    @property
    def ep_axis(self) -> int | None:
        return 1 if self.ep > 1 else None

    @property
    def cp_axis(self) -> int | None:
        return len(self.grid) - 2 if self.cp > 1 else None

    @property
    def data_axes(self) -> tuple[int, ...]:
        """The axes the batch is split over (ZeRO's too): dp, and ep if any."""
        return (0, 1) if self.ep > 1 else (0,)

    def ranks_of_stage(self, stage: int) -> Sequence[int]:
        """A stage's ranks (consecutive ones as a `range`: indexed and searched
        in O(1), not built, at 8192 ranks a stage)."""
        if self.stage_ranks:
            return self.stage_ranks[stage]
        n = self.dp * self.cp * self.tp
        return range(stage * n, (stage + 1) * n)

    def placement(self, stage: int) -> Placement:
        """Stage `stage`'s ranks as a grid (`grid`, `axes`)."""
        return Placement(self.ranks_of_stage(stage), self.grid)

    def stage_of_rank(self, rank: int) -> int:
        if not self.stage_ranks and 0 <= rank < self.pp * self.dp * self.cp * self.tp:
            return rank // (self.dp * self.cp * self.tp)
        for s in range(self.pp):
            if rank in self.ranks_of_stage(s):
                return s
        raise ValueError(f"rank {rank} is in no stage")
