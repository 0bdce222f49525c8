"""Schedule actions: one record per thing a stage does in a pipeline step.

Invariants:
- `virtual_stage` is a virtual stage index, the model's pieces in order
  0..pp*vpp-1 (the numbering of torch.distributed.pipelining). The
  pipeline stage (position 0..pp-1, the `stage` argument of a schedule's
  action function; for pp-only layouts its rank) that runs it is the
  schedule's placement (`schedules.placement_of`): by default
  (interleaved) virtual stage `chunk * pp + stage`.
  STEP has `virtual_stage == microbatch == -1`.
- Compute actions have `peer == -1`: F (forward), B (the whole backward),
  or the backward split in two, I (gradients of the stage's inputs, which
  the previous stage waits for) and W (gradients of the stage's weights,
  which nobody waits for); B = I + W. A (stage, micro-batch) runs B, or I
  then W, never both. SEND/RECV actions always carry a concrete `peer`
  (the virtual stage on the other side); leaving it out means the chain
  neighbour (SEND_F: stage+1, RECV_F: stage-1, SEND_B: stage-1, RECV_B:
  stage+1), filled in at construction.
- `str(a)` is `0F3`, `2B1`, `2I0`, `2W0`, `0SEND_F3`, `1RECV_B0`, `STEP`; a
  non-default peer is written as `@<peer>` (`0SEND_F3@2`). `Action.parse(str(a)) == a`
  for every valid action. F, B, I, W and the SEND/RECV forms without a peer
  are torch.distributed.pipelining's `_Action` text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from meshplan.errors import ScheduleError


class ActionType(Enum):
    """What an action does; F/B/I/W compute, SEND/RECV move one transfer."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (torch's letter for the backward of the inputs)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    STEP = "STEP"

    @property
    def is_compute(self) -> bool:
        # identity tests: an Enum's hash and == run Python code (hot in the search)
        t = ActionType
        return self is t.F or self is t.B or self is t.I or self is t.W

    @property
    def is_send(self) -> bool:
        return self in (ActionType.SEND_F, ActionType.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (ActionType.RECV_F, ActionType.RECV_B)

    @property
    def is_comm(self) -> bool:
        return self.is_send or self.is_recv

    @property
    def kind(self) -> ActionType:
        """The transfer kind (F or B) this action moves, or the compute kind it runs."""
        if self in (ActionType.SEND_F, ActionType.RECV_F):
            return ActionType.F
        if self in (ActionType.SEND_B, ActionType.RECV_B):
            return ActionType.B
        if self.is_compute:
            return self
        raise ValueError("STEP has no compute kind")

    @property
    def transfer(self) -> ActionType | None:
        """The transfer kind a compute action produces and consumes: F for F;
        B (the input gradient) for B and I; None for W, which moves nothing."""
        return {ActionType.F: ActionType.F, ActionType.B: ActionType.B,
                ActionType.I: ActionType.B}.get(self)


# The chain neighbour each SEND/RECV talks to by default (peer = stage + offset).
_DEFAULT_PEER_OFFSET = {
    ActionType.SEND_F: +1,
    ActionType.RECV_F: -1,
    ActionType.SEND_B: -1,
    ActionType.RECV_B: +1,
}

_PATTERN = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:@(\d+))?")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage's schedule; see the module docstring."""

    virtual_stage: int
    type: ActionType
    microbatch: int
    peer: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.type, ActionType):
            raise ScheduleError(f"action type must be an ActionType, got {self.type!r}")
        if self.type is ActionType.STEP:
            if (self.virtual_stage, self.microbatch, self.peer) != (-1, -1, -1):
                raise ScheduleError("STEP takes no stage, microbatch or peer; use Action.step()")
            return
        if self.virtual_stage < 0 or self.microbatch < 0:
            raise ScheduleError(
                f"action {self.type.value} needs stage >= 0 and microbatch >= 0, "
                f"got stage={self.virtual_stage} microbatch={self.microbatch}"
            )
        if self.type.is_compute:
            if self.peer != -1:
                raise ScheduleError(f"compute action {self.virtual_stage}{self.type.value}"
                                    f"{self.microbatch} takes no peer (got {self.peer})")
            return
        self._fill_peer()

    def _fill_peer(self) -> None:
        peer = self.peer
        if peer == -1:
            peer = self.virtual_stage + _DEFAULT_PEER_OFFSET[self.type]
            if peer < 0:
                raise ScheduleError(
                    f"{self.virtual_stage}{self.type.value}{self.microbatch} has no chain "
                    f"neighbour at stage {peer}; give an explicit peer (`@<stage>`)"
                )
            object.__setattr__(self, "peer", peer)
        elif peer < 0 or peer == self.virtual_stage:
            raise ScheduleError(f"{self.virtual_stage}{self.type.value}{self.microbatch}: "
                                f"peer must be another stage >= 0, got {peer}")

    @staticmethod
    def step() -> Action:
        """The optimizer step action (`STEP`)."""
        return Action(-1, ActionType.STEP, -1)

    @property
    def default_peer(self) -> bool:
        """True when a SEND/RECV talks to its chain neighbour."""
        offset = _DEFAULT_PEER_OFFSET.get(self.type)
        return offset is not None and self.peer == self.virtual_stage + offset

    def __str__(self) -> str:
        if self.type is ActionType.STEP:
            return "STEP"
        text = f"{self.virtual_stage}{self.type.value}{self.microbatch}"
        if self.type.is_comm and not self.default_peer:
            text += f"@{self.peer}"
        return text

    @staticmethod
    def parse(text: str) -> Action:
        """Invert `str()`: `'0SEND_F3@2'` -> `Action(0, SEND_F, 3, peer=2)`."""
        if not isinstance(text, str):
            raise ScheduleError(f"cannot parse action from {type(text).__name__} {text!r}")
        s = text.strip()
        if s == "STEP":
            return Action.step()
        match = _PATTERN.fullmatch(s)
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}; expected <stage><F|B|I|W|SEND_F|RECV_F|"
                f"SEND_B|RECV_B><microbatch>[@<peer>] (e.g. 0F3, 2I0, 0SEND_F3@2) or STEP"
            )
        stage, kind, mb, peer = match.groups()
        atype = ActionType(kind)
        if peer is not None and not atype.is_comm:
            raise ScheduleError(f"cannot parse action {text!r}: only SEND/RECV take `@<peer>`")
        return Action(int(stage), atype, int(mb), -1 if peer is None else int(peer))
