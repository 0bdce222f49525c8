"""A rank's progress, as the launcher and the driver read it while the run
goes on.

Invariants:
- `beats[rank]` is the `time.monotonic()` (one clock for every process of
  the machine) of the rank's last action start: its progress; a thread
  stamps `beats[world + rank]` every half second while the process runs:
  its liveness (`runtime/launch.py` reads both).
- Step rows are appended and flushed one line at a time: a reader sees
  whole lines only, or a last line still being written.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from meshplan.ir import LR
from meshplan.ir.fileio import LineLog


def reporter(rank: int, progress, beats):
    """The executor's per-action hook: the action's index for the launcher's
    failure line, and the time of the rank's last progress (`beats[rank]`)
    its stall check reads."""
    if progress is None and beats is None:
        return None

    def report(index: int) -> None:
        if progress is not None:
            progress[rank] = index
        if beats is not None:
            beats[rank] = time.monotonic()

    return report


def progress_only(beats, rank: int):
    """The evaluator's hook: progress, without an index of the train plan."""
    if beats is None:
        return None

    def report(index: int) -> None:
        beats[rank] = time.monotonic()

    return report


def start_liveness(alive, rank: int, every_s: float = 0.5) -> None:
    """A daemon thread stamping `alive[rank]` every `every_s`: it stops only
    when the whole process stops (frozen, swapped out, stopped by a signal),
    which tells the launcher which rank is frozen rather than waiting."""
    def stamp() -> None:
        while True:
            alive[rank] = time.monotonic()
            time.sleep(every_s)

    threading.Thread(target=stamp, name="meshplan-liveness", daemon=True).start()


class StepRows:
    """Each step's and evaluation's numbers as one JSON line of `path` (a
    rank's `<results>/steps_<rank>.jsonl`; nothing when None), flushed as
    it happens, so the driver writes metrics while the run goes on."""

    def __init__(self, path: Path | None, peak):
        self.peak = peak  # () -> the rank's measured peak bytes so far
        self.log = LineLog(path) if path is not None else None

    def _write(self, row: dict) -> None:
        if self.log is not None:
            self.log.write(json.dumps(row))

    def train(self, step: int, loss, norm, state: dict, step_s: float,
              samples: list[int] | None = None, reports: dict | None = None) -> None:
        """A step's row; `samples`: the sample ids this rank read for it;
        `reports`: the graph's reports this rank made, by name."""
        lr = float(state[LR]) if LR in state else None
        self._write({"step": step, "loss": loss, "grad_norm": norm, "lr": lr,
                     "step_s": step_s, "peak_bytes": self.peak(), "samples": samples,
                     **({"reports": reports} if reports else {})})

    def eval(self, step: int, loss) -> None:
        self._write({"eval_step": step, "eval_loss": loss})
