"""The planned peak against the CPU allocator's peak: on one rank, and on
every rank of gloo runs in processes.

GPT tiny, and GPT tiny with a 4096-token vocabulary, 2 layers and 8
positions (its state outweighs its activations, so the optimizer's step
sets the peak), over its second step: the allocator's peak from torch's
profiler memory events (every tensor the rank allocates, kernels'
temporaries included: `tests/allocator.py`), against the plan as it is
and the plan without the optimizer's workspace (`memory._update_temp`, as
before it was counted). Bytes are deterministic: one run.

On several ranks (`tests/runtime/test_allocator_ranks.py`'s cases, each
rank a process on gloo) the peak moves with what is in flight when, so
each case runs three times and the lowest margin over its ranks and runs
is reported; against it, the plan without the collectives' workspace
(`memory.collective_temp`, as before it was counted), and the peak when
ZeRO 1 and 2's gathers write fresh tensors (as before).

    python benchmarks/allocator_memory.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, write  # noqa: E402
from meshplan.lowering import memory  # noqa: E402
from tests.runtime import test_allocator_ranks as ranks  # noqa: E402
from tests.runtime.test_memory import STATE_HEAVY, allocated_and_planned  # noqa: E402

RUNS = 3

CASES = [("adamw", False, 8, 8, {}), ("adamw", False, 1, 1, STATE_HEAVY),
         ("adamw", True, 1, 1, STATE_HEAVY), ("adamw", False, 2, 1, STATE_HEAVY),
         ("sgd", True, 1, 1, STATE_HEAVY), ("sgd", False, 1, 1, STATE_HEAVY)]


def _ranks(case: str, bug: str = "-") -> list[tuple[int, int]]:
    world, overrides, fields = ranks.CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        return ranks.allocated_and_planned(Path(tmp), world, overrides, bug, **fields)


def multi_rank() -> tuple[list[dict], list[str]]:
    rows = []
    for case in ranks.CASES:
        runs = [_ranks(case) for _ in range(RUNS)]
        peaks = [max(run[r][0] for run in runs) for r in range(len(runs[0]))]
        planned = [p for _, p in runs[0]]
        before = [p for _, p in _ranks(case, "no_comm_temp")]
        copied = max(a for a, _ in _ranks(case, "copy"))
        rows.append({"case": case, "ranks": len(peaks), "allocated": peaks, "planned": planned,
                     "planned_before": before, "allocated_copying": copied,
                     "margin": min(p / a - 1 for p, a in zip(planned, peaks)),
                     "margin_before": min(p / a - 1 for p, a in zip(before, peaks))})
    lines = ["| case | ranks | allocator peak, most of any rank (B) | planned, that rank's (B) "
             "| plan over the peak, least of any rank | without the collectives' workspace "
             "| peak with fresh gathered parameters (B) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        k = max(range(r["ranks"]), key=lambda i: r["allocated"][i])
        lines.append(f"| {r['case']} | {r['ranks']} | {r['allocated'][k]} | {r['planned'][k]} | "
                     f"{r['margin']:+.1%} | {r['margin_before']:+.1%}"
                     f"{'' if r['margin_before'] >= 0 else ' (NOT a bound)'} | "
                     f"{r['allocated_copying']} |")
    return rows, lines


def main() -> None:
    rows = []
    counted = memory._update_temp
    for optimizer, clip, batch, micro, overrides in CASES:
        measured, planned = allocated_and_planned(optimizer, clip, batch, micro, **overrides)
        memory._update_temp = lambda low, order: 0
        try:
            _, before = allocated_and_planned(optimizer, clip, batch, micro, **overrides)
        finally:
            memory._update_temp = counted
        rows.append({"model": "gpt tiny" + (", state-heavy" if overrides else ""),
                     "optimizer": optimizer, "clip": clip, "batch": batch, "micro": micro,
                     "allocated": measured, "planned": planned, "planned_before": before})
    lines = ["| model | optimizer | clipping | batch / micro | allocator peak (B) | planned (B) "
             "| plan over the peak | without the update workspace |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        before = r["planned_before"] / r["allocated"] - 1
        lines.append(f"| {r['model']} | {r['optimizer']} | {'yes' if r['clip'] else 'no'} | "
                     f"{r['batch']} / {r['micro']} | {r['allocated']} | {r['planned']} | "
                     f"{r['planned'] / r['allocated'] - 1:+.1%} | {before:+.1%}"
                     f"{'' if before >= 0 else ' (NOT a bound)'} |")
    across, more = multi_rank()
    lines += ["", f"Every rank, gloo processes, AdamW, {RUNS} runs each "
              "(`tests/runtime/test_allocator_ranks.py`'s cases):", ""] + more
    write("allocator_memory", {"machine": machine(), "rows": rows, "ranks": across},
          "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
