"""Typed results of the driver's verbs, and their JSON.

Invariants:
- A result is a dataclass; code reads its attributes. `to_json()` is the
  object the CLI prints with `--json`, with the keys it always had.
- For callers written against the old dicts, a result is also a read-only
  `Mapping` over `to_json()` (`r["losses"]`); it holds no data of its own
  beyond the attributes, so the two views cannot disagree.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class JsonResult(Mapping):
    """The read-only Mapping view of a result's `to_json()`."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


def steady_step_s(step_s: list[float]) -> float | None:
    """The median step time after the first, which carries the warm-up (lazy
    builds of kernels, first allocations): the first alone in a 1-step run."""
    return statistics.median(step_s[1:] or step_s) if step_s else None


@dataclass(eq=False)
class RunResult(JsonResult):
    """What `run` reports: the losses (the last stage's), the slowest rank's
    step times, memory and kernels per rank, and with `report_state` every
    rank's final state slices (tensors: not part of the JSON)."""

    losses: list[float]
    step_s: list[float]
    rank_losses: dict[str, list[float]]
    median_step_s: float | None
    ranks: dict[str, dict[str, Any]]
    job_digest: str | None
    wall_s: float
    first_step: int
    trace: dict[str, Any] | None
    # clipping: the global gradient norm per step, by rank (every rank computes it)
    rank_grad_norms: dict[str, list[float]] = field(default_factory=dict)
    # the guard's `--on-nonfinite skip`: the steps no rank applied (norm inf/nan)
    skipped_steps: list[int] = field(default_factory=list)
    state_slices: dict[int, dict] | None = field(default=None, repr=False)
    # samples each rank's token reader read (None: the rank had no reader)
    rows_read: dict[str, int | None] = field(default_factory=dict)
    # the graph's reports, per step (a mixture of experts' tokens per expert,
    # `tokens_per_expert/<block>`: its router's choices, summed over the batch)
    reports: dict[str, list] = field(default_factory=dict)

    @property
    def grad_norms(self) -> list[float]:
        """The gradient norm per step (rank 0's; every rank's is the same)."""
        return next(iter(self.rank_grad_norms.values()), [])

    def to_json(self) -> dict[str, Any]:
        return {"losses": self.losses, "grad_norms": self.grad_norms, "step_s": self.step_s,
                "rank_losses": self.rank_losses, "rank_grad_norms": self.rank_grad_norms,
                "skipped_steps": self.skipped_steps,
                "median_step_s": self.median_step_s, "ranks": self.ranks,
                "job_digest": self.job_digest, "wall_s": self.wall_s,
                "first_step": self.first_step, "trace": self.trace,
                **({"reports": self.reports} if self.reports else {})}


@dataclass(eq=False)
class LowerResult(JsonResult):
    """What `compile_job` reports: per-rank lowering statistics, the workers
    and their peak memory, and the kernel-workspace inference counts."""

    ranks: dict[int, dict[str, Any]]
    workers: int
    worker_maxrss_bytes: int
    open_s: float
    temp_signatures: int
    temp_rank_calls: int

    def to_json(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "workers": self.workers,
                "worker_maxrss_bytes": self.worker_maxrss_bytes, "open_s": self.open_s,
                "temp_inference": {"signatures": self.temp_signatures,
                                   "rank_calls": self.temp_rank_calls}}


@dataclass(eq=False)
class CompileResult(JsonResult):
    """What `compile_model` reports: the master's times, then `lowering`."""

    capture_s: float
    master_s: float
    passes_s: dict[str, float]
    job_digest: str
    lowering: LowerResult
    logical_inference: dict[str, Any]
    master_temp_calls: int
    master_maxrss_bytes: int

    def to_json(self) -> dict[str, Any]:
        low = self.lowering.to_json()
        return {"capture_s": self.capture_s, "master_s": self.master_s,
                "passes_s": self.passes_s, "job_digest": self.job_digest, **low,
                "inference": {"logical": self.logical_inference,
                              "temp": {**low["temp_inference"],
                                       "master_calls": self.master_temp_calls}},
                "master_maxrss_bytes": self.master_maxrss_bytes}


@dataclass(eq=False)
class VerifyResult(JsonResult):
    """What `verify` reports: the verdict (`ok`, one line per problem), both
    loss curves, every parameter's and optimizer slot's comparison after the
    last step, and `details`: the rest, which depends on the mode (single
    process or distributed) and the precision (the fp32 second judge)."""

    ok: bool
    problems: list[str]
    losses: list[float]
    ref_losses: list[float]
    rank_losses: dict[str, list[float]]
    max_abs_diff: float
    params: dict[str, dict[str, Any]]
    optimizer_state: dict[str, dict[str, Any]]
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, verdict: dict[str, Any], losses: list[float], ref_losses: list[float],
           rank_losses: dict[str, list[float]], **details: Any) -> VerifyResult:
        """From `driver.verify.judge`'s verdict and the run's own figures."""
        v = dict(verdict)
        core = {k: v.pop(k) for k in ("ok", "problems", "max_abs_diff", "params",
                                      "optimizer_state")}
        return cls(losses=losses, ref_losses=ref_losses, rank_losses=rank_losses,
                   details=v | details, **core)

    def to_json(self) -> dict[str, Any]:
        return self.details | {
            "ok": self.ok, "problems": self.problems, "losses": self.losses,
            "ref_losses": self.ref_losses, "rank_losses": self.rank_losses,
            "max_abs_diff": self.max_abs_diff, "params": self.params,
            "optimizer_state": self.optimizer_state}
