"""Names of per-parameter state: `<fqn>@<slot>`.

Invariants:
- A state name is a parameter's FQN, `@`, then a slot: `wte.weight@exp_avg`,
  and `wte.weight@grad` for the gradient accumulator. A slot holds no `@`,
  so the FQN is everything before the last `@`, and `str(StateName.parse(n))
  == n` for every state name `n`.
- GradScaler's scale, `amp@loss_scale` (`graph.LOSS_SCALE`), has the same
  form; its "fqn" `amp` names no parameter.
- A name without `@` is a parameter or buffer, never state (`is_state`).
"""

from __future__ import annotations

from dataclasses import dataclass

SEP = "@"
GRAD = "grad"  # the slot of a parameter's gradient accumulator


@dataclass(frozen=True, slots=True)
class StateName:
    fqn: str
    slot: str

    def __post_init__(self) -> None:
        assert self.fqn and self.slot and SEP not in self.slot, (self.fqn, self.slot)

    @staticmethod
    def parse(name: str) -> StateName:
        """`<fqn>@<slot>` split at its last `@` (`name` must be a state name)."""
        fqn, sep, slot = name.rpartition(SEP)
        assert sep, f"{name!r} is not a state name <fqn>{SEP}<slot>"
        return StateName(fqn, slot)

    @staticmethod
    def grad(fqn: str) -> StateName:
        """The gradient accumulator of parameter `fqn`."""
        return StateName(fqn, GRAD)

    def __str__(self) -> str:
        return f"{self.fqn}{SEP}{self.slot}"


def is_state(name: str) -> bool:
    """Whether `name` names state (`<fqn>@<slot>`), not a parameter or buffer."""
    return SEP in name
