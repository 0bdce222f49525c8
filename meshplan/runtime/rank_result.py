"""What one rank reports at the end of a run, and its one file form.

Invariants:
- `RankResult` is written once per rank (`rank_<r>.json`, or gathered to
  rank 0 as `all_ranks.json` under torchrun, where no file system is
  shared) and read back by the driver; `to_json` / `from_json` are the one
  place its keys are spelled.
- Losses are held by the ranks that compute the loss (the last stage);
  the other ranks' are empty.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

ALL_RANKS = "all_ranks.json"


def result_name(rank: int) -> str:
    return f"rank_{rank}.json"


@dataclass(frozen=True)
class RankResult:
    rank: int
    losses: list[float]             # per step (empty off the loss's stage)
    grad_norms: list[float]         # per step, with clipping or the non-finite guard
    skipped_steps: list[int]        # steps the non-finite guard skipped
    step_s: list[float]             # each step's seconds on this rank
    first_step: int                 # the step the run started from (a resume's)
    planned_peak_bytes: int
    planned_peak: dict[str, int]    # by category, and "total"
    measured_peak_bytes: int        # CUDA's allocator on a GPU, else the live-bytes count
    live_peak_bytes: int
    device: str
    attention_fallbacks: dict[str, int] = field(default_factory=dict)
    attention_ran: dict[str, int] = field(default_factory=dict)
    trace: list | None = None       # the traced step's span rows (`Span.to_json`)
    rows_read: int | None = None    # the samples this rank's feed read
    # the graph's reports this rank makes (its stage's): name -> per step, the
    # micro-batches' sum (a mixture of experts' tokens per expert)
    reports: dict[str, list] = field(default_factory=dict)
    # `--kernels inductor`: seconds of the runs' first calls (Inductor's compile, or
    # its cache's load, and one run), and the notes of runs it refused
    kernel_compile_s: float = 0.0
    kernel_notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(data: dict) -> RankResult:
        return RankResult(**data)

    def memory(self) -> dict:
        """This rank's entry in `RunResult.ranks`: its planned and measured peaks."""
        return {"planned_peak_bytes": self.planned_peak_bytes,
                "measured_peak_bytes": self.measured_peak_bytes,
                "live_peak_bytes": self.live_peak_bytes, "device": self.device,
                "attention_fallbacks": self.attention_fallbacks,
                "attention_ran": self.attention_ran, "planned_peak": self.planned_peak,
                "kernel_compile_s": self.kernel_compile_s, "kernel_notes": self.kernel_notes}


def read_results(results: Path, world: int) -> dict[int, RankResult]:
    """Every rank's result file in `results`."""
    return {r: RankResult.from_json(json.loads((results / result_name(r)).read_text()))
            for r in range(world)}


def read_gathered(results: Path) -> dict[int, RankResult]:
    """The results rank 0 gathered from every rank (`ALL_RANKS`)."""
    rows = json.loads((results / ALL_RANKS).read_text())
    return {row["rank"]: RankResult.from_json(row) for row in rows}
