"""Validate a (mesh, strategy) pair and resolve its defaults.

Invariant: every check here raises one `ConfigError` line that says what is
wrong, with the numbers, and how to fix it; a strategy that passes makes
`dp * cp * tp * pp == world` and a whole number of micro-batches per step.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.errors import ConfigError
from meshplan.ir.choices import TpStyle
from meshplan.ir.mesh import CP_ATTENTION, Mesh, Strategy
from meshplan.schedules import spec_of, stage_placement
from meshplan.schedules.registry import MicroBatches

# The Megatron plan for the zoo's transformers: qkv and fc1 column-parallel,
# proj and fc2 row-parallel, embedding and head vocab-parallel.
MEGATRON_PLAN = (
    (r"blocks\.\d+\.attn\.qkv", TpStyle.COLWISE),
    (r"blocks\.\d+\.attn\.proj", TpStyle.ROWWISE),
    (r"blocks\.\d+\.mlp\.fc1", TpStyle.COLWISE),
    (r"blocks\.\d+\.mlp\.fc2", TpStyle.ROWWISE),
    (r"wte", TpStyle.VOCAB),
    (r"head", TpStyle.VOCAB),
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_strategy(mesh: Mesh, s: Strategy) -> Strategy:
    """Validate; returns the strategy with `schedule` defaults resolved."""
    if s.auto:
        raise ConfigError("Strategy(auto=True) is resolved by meshplan.api.plan (or --auto), "
                          "which searches a Strategy; plan the graph through it")
    for name in ("dp", "tp", "pp", "vpp", "ep", "cp", "global_batch_size", "micro_batch_size"):
        if getattr(s, name) < 1:
            raise ConfigError(f"{name}={getattr(s, name)} must be >= 1; pass a positive "
                              f"--{name.replace('_', '-')}")
    if mesh.nodes < 1 or mesh.devices_per_node < 1:
        raise ConfigError(f"mesh {mesh.nodes} nodes x {mesh.devices_per_node} devices "
                          "must have at least one of each; pass --nodes and "
                          "--devices-per-node >= 1")
    if s.dp * s.cp * s.tp * s.pp != mesh.world and not s.stage_ranks:
        cp, cps = (f"*{s.cp}", "cp*") if s.cp > 1 else ("", "")
        raise ConfigError(
            f"dp*{cps}tp*pp = {s.dp}{cp}*{s.tp}*{s.pp} = {s.dp * s.cp * s.tp * s.pp} but the "
            f"mesh has {mesh.nodes}x{mesh.devices_per_node} = {mesh.world} ranks; pass "
            f"--devices-per-node {s.dp * s.cp * s.tp * s.pp // mesh.nodes or 1} (ranks per "
            f"machine; --nodes x it = all ranks), or choose dp, {cps.replace('*', ', ')}tp, pp "
            f"whose product is {mesh.world}")
    if s.cp_attention not in CP_ATTENTION:
        raise ConfigError(f"cp attention {s.cp_attention!r} is unknown; choose one of "
                          f"{', '.join(CP_ATTENTION)}")
    if s.cp > 1 and s.ep > 1:
        raise ConfigError("context parallelism (--cp) with expert parallelism (--ep) is not "
                          "planned yet; use one of them")
    if s.sequence_parallel and s.tp == 1:
        raise ConfigError("sequence parallelism splits the sequence over the tensor-parallel "
                          "ranks; it needs tp > 1: pass --tp 2 (or more), or drop "
                          "--sequence-parallel")
    if s.dp % s.ep:
        ok = [d for d in _divisors(s.dp) if d > 1]
        raise ConfigError(f"ep={s.ep} does not divide dp={s.dp}: expert parallelism splits the "
                          "experts over ranks of one data-parallel group; choose ep among "
                          f"{', '.join(map(str, ok)) or '1 (dp is 1)'}, or raise dp")
    spec = spec_of(s.schedule)
    if spec.at_vpp(s.vpp) != s.schedule:
        s = replace(s, schedule=spec.at_vpp(s.vpp))
        spec = spec_of(s.schedule)
    if s.bucket_mb < 0:
        raise ConfigError(f"bucket_mb={s.bucket_mb} must be >= 0; pass --bucket-mb 25 (DDP's "
                          "default) or 0 for no buckets")
    if (spec.actions is None) != bool(s.schedule_orders):
        raise ConfigError("a schedule read from a CSV comes with its orders: give "
                          "--schedule-csv FILE (Strategy.schedule_orders), not --schedule csv")
    if s.schedule_orders and len(stage_placement(s).ranks) != s.pp * s.vpp:
        raise ConfigError(f"the schedule CSV runs {len(stage_placement(s).ranks)} stages but "
                          f"pp*vpp = {s.pp}*{s.vpp}; pass --vpp "
                          f"{len(stage_placement(s).ranks) // s.pp}")
    if spec.chunks and s.vpp != spec.chunks:
        raise ConfigError(f"schedule {s.schedule} places {spec.chunks} virtual stages on each "
                          f"rank, got vpp={s.vpp}; pass --vpp {spec.chunks}")
    per_step = s.micro_batch_size * s.dp
    if s.global_batch_size % per_step:
        raise ConfigError(
            f"global batch {s.global_batch_size} is not a multiple of micro-batch "
            f"{s.micro_batch_size} x dp {s.dp} = {per_step}; use a global batch of "
            f"{per_step * max(1, s.global_batch_size // per_step)} or "
            f"{per_step * (s.global_batch_size // per_step + 1)}")
    m = s.num_microbatches
    if spec.microbatches != MicroBatches.ANY and m < s.pp:
        raise ConfigError(
            f"{s.schedule} needs num_microbatches >= pp, got {m} < {s.pp}; raise the global "
            f"batch to {s.pp * per_step} or use --schedule gpipe")
    if spec.microbatches == MicroBatches.ROUNDS_OF_PP and m % s.pp:
        lo, hi = (m // s.pp) * s.pp, (m // s.pp + 1) * s.pp
        raise ConfigError(
            f"{s.schedule} needs num_microbatches to be a multiple of pp, got {m} for pp={s.pp}; "
            f"use --num-microbatches {f'{lo} or {hi}' if lo else hi}")
    _check_stage_ranks(mesh, s)
    return s


def _check_stage_ranks(mesh: Mesh, s: Strategy) -> None:
    if not s.stage_ranks:
        return
    if len(s.stage_ranks) != s.pp:
        raise ConfigError(f"{len(s.stage_ranks)} stage rank lists given for pp={s.pp}; "
                          "give one list per stage")
    seen: set[int] = set()
    for i, ranks in enumerate(s.stage_ranks):
        if len(ranks) != s.dp * s.cp * s.tp:
            raise ConfigError(f"stage {i} lists {len(ranks)} ranks, but dp*cp*tp = "
                              f"{s.dp * s.cp * s.tp}")
        bad = [r for r in ranks if not 0 <= r < mesh.world or r in seen]
        if bad:
            raise ConfigError(f"stage {i} lists rank {bad[0]}, which is outside 0..{mesh.world - 1}"
                              " or already in another stage; each rank belongs to one stage")
        seen.update(ranks)


def check_heads(heads: int, tp: int, model: str) -> None:
    """Tensor parallelism splits attention heads: tp must divide them."""
    if tp > 1 and model == "resnet":
        raise ConfigError(f"resnet has no tensor-parallel plan (tp={tp}); use --tp 1 and "
                          "spread the ranks over --dp and --pp")
    if heads % tp:
        ok = [d for d in _divisors(heads) if d <= 64]
        raise ConfigError(f"{model}: tp={tp} does not divide heads={heads}; choose tp among "
                          f"{', '.join(map(str, ok))}")
