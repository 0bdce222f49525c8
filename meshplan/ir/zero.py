"""What a ZeRO level means (sharded data parallel, `Strategy.zero`).

Invariants:
- `ZeroLevel` is an `IntEnum`: a member is its int, so it compares, hashes,
  formats and encodes to JSON as the int users write (`--zero 2`, `zero2`),
  and a Job holding one is byte for byte the Job holding the int.
- The one table of what each level shards at rest over dp is
  `_SHARDED_FROM` (a role's least level); every other fact (the gradients
  reduce-scattered, the parameters gathered again before each use) is a
  property here. Nothing outside this module compares a level with an int
  (`tests/ir/test_zero_level.py` holds it).
- `ZeroLevel.parse` is the one way a user's int becomes a level: a bad one
  is one `ConfigError` line naming the levels.
"""

from __future__ import annotations

import enum

from meshplan.errors import ConfigError
from meshplan.ir.graph import Role


class ZeroLevel(enum.IntEnum):
    """ZeRO's stages: each shards over dp what the one below does, and more."""

    NONE = 0        # plain data parallel: every state whole on every dp rank
    OPTIMIZER = 1   # the optimizer state sharded
    GRADIENTS = 2   # and the gradient accumulators
    PARAMETERS = 3  # and the parameters (gathered before each use, as FSDP does)

    @classmethod
    def parse(cls, value: int, where: str = "") -> ZeroLevel:
        """`value` as a level; a bad one is one ConfigError line (`where`, if
        given, says where it was written)."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"zero={value}{where} is not a ZeRO stage; use --zero 0 (plain "
                              "data parallel), 1 (optimizer state), 2 (and gradients) or 3 "
                              "(and parameters)") from None

    def shards(self, role: Role) -> bool:
        """Whether a state of `role` rests sharded over dp at this level."""
        return role in _SHARDED_FROM and self >= _SHARDED_FROM[role]

    @property
    def shards_optimizer(self) -> bool:
        """The optimizer state is sharded: the step updates a shard, then
        gathers the parameters (levels 1 and 2; at 3 they stay sharded)."""
        return self.shards(Role.OPT_STATE)

    @property
    def reduce_scatters(self) -> bool:
        """The gradient accumulators are sharded: the backward reduce-scatters
        each gradient (levels 2 and 3; level 1 does it in the step)."""
        return self.shards(Role.GRAD)

    @property
    def regathers(self) -> bool:
        """The parameters are sharded: each is gathered before each use, in
        the forward and again in the backward (level 3)."""
        return self.shards(Role.PARAM)


_SHARDED_FROM = {Role.OPT_STATE: ZeroLevel.OPTIMIZER, Role.GRAD: ZeroLevel.GRADIENTS,
                 Role.PARAM: ZeroLevel.PARAMETERS}  # role -> the least level sharding it
