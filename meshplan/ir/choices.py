"""The closed sets a user or a rule picks from by name.

Invariants:
- Each member's value is the string users write (`--precision bf16`, config
  names, plan files). A `StrEnum` member *is* that string: it compares,
  hashes, formats and encodes to JSON as it, so plans stay byte for byte
  what they were with bare strings.
- Pipeline schedules are not here: a schedule is a record of
  `schedules/registry.py` (open to a new one), named by a plain string.
- `choose` is the one way a user's string becomes a member: a bad value is
  one `ConfigError` line naming the choices.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from meshplan.errors import ConfigError


class Precision(enum.StrEnum):
    """Compute precision; bf16 and fp16 keep fp32 master weights (fp16 adds loss scaling)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class Recompute(enum.StrEnum):
    """Activation checkpointing: full keeps only each region's input, selective
    also keeps matmul/attention outputs."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


class OpPrecision(enum.StrEnum):
    """How an op computes under mixed precision (`OpRule.precision`, autocast's lists)."""

    PROMOTE = ""   # follow type promotion
    LOW = "low"    # in bf16/fp16: every floating-point input cast down (a graph captured
    #                under autocast has them cast already; one left fp32 ran with autocast off)
    LOW_INSIDE = "low_inside"  # as LOW in any graph: autocast lists not the op but lowers
    #                the matmul it computes by (einsum's bmm), which a capture does not see
    FP32 = "fp32"  # in fp32: low-precision inputs cast back


class OpRecompute(enum.StrEnum):
    """What selective recompute does with an op (`OpRule.recompute`)."""

    FREE = ""          # recompute it freely
    KEEP = "keep"      # keep its output (costly to redo, or communication)


class TpStyle(enum.StrEnum):
    """How a tensor-parallel plan splits one module (`passes/tp_plan.py`)."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    VOCAB = "vocab"
    REPLICATE = "replicate"


class OptimizerKind(enum.StrEnum):
    """The optimizer of the train step; its op is `meshplan.<kind>`."""

    SGD = "sgd"
    ADAMW = "adamw"


class LrScheduleKind(enum.StrEnum):
    """The learning rate's shape after its linear warmup (`ir/lr_schedule.py`)."""

    CONSTANT = "constant"
    LINEAR = "linear"      # linear decay to min_lr over decay_steps
    COSINE = "cosine"      # cosine decay to min_lr over decay_steps
    WSD = "wsd"            # warmup-stable-decay: stable, then linear to min_lr at the end


class NonFinite(enum.StrEnum):
    """What a step whose gradient norm is inf/nan does (`--on-nonfinite`)."""

    HALT = "halt"  # stop the run, naming the step
    SKIP = "skip"  # no rank applies the update; training goes on


class Kernels(enum.StrEnum):
    """How a rank runs its compute ops (`--kernels`, `runtime/fused.py`)."""

    EAGER = "eager"        # one aten kernel per op
    INDUCTOR = "inductor"  # each run of compute ops between communications compiled


class KernelVariant(enum.StrEnum):
    """A rank-dependent variant of an op's kernel along one mesh axis (`Job.variant`)."""

    NONE = ""
    BIAS_FIRST = "bias_first"      # only the axis's first rank adds the bias
    VOCAB_OFFSET = "vocab_offset"  # embedding rows [lo, hi) of the vocabulary
    CLASS_OFFSET = "class_offset"  # nll_loss over classes [lo, hi)
    MEAN_RESCALE = "mean_rescale"  # a mean over a sharded dim, rescaled to the global count
    REPLICA_FIRST = "replica_first"  # a replicated piece counted by the axis's first rank only
    CAUSAL_OFFSET = "causal_offset"  # causal attention of a sequence shard of the queries
    RING = "ring"  # attention of sequence shards, keys and values passed around the axis's ring
    EXPERTS = "experts"  # routed experts of a token shard: rows sent to the axis's expert shards


E = TypeVar("E", bound=enum.StrEnum)


def names(kind: type[enum.StrEnum]) -> tuple[str, ...]:
    """The values of `kind`'s members as plain strings (argparse `choices`)."""
    return tuple(m.value for m in kind)


def choose(kind: type[E], value: str, what: str, where: str = "") -> E:
    """`value` as a member of `kind`; a bad value is one ConfigError line
    (`what` names the setting: "schedule", "precision", ...; `where`, if
    given, says where the value was written)."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"unknown {what} '{value}'{where}: choose one of "
                          f"{', '.join(names(kind))}") from None
