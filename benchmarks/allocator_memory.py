"""The planned peak against the CPU allocator's peak, on one rank.

GPT tiny, and GPT tiny with a 4096-token vocabulary, 2 layers and 8
positions (its state outweighs its activations, so the optimizer's step
sets the peak), over its second step: the allocator's peak from torch's
profiler memory events (every tensor the rank allocates, kernels'
temporaries included: `tests/allocator.py`), against the plan as it is
and the plan without the optimizer's workspace (`memory._update_temp`, as
before it was counted). Bytes are deterministic: one run.

    python benchmarks/allocator_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, write  # noqa: E402
from meshplan.lowering import memory  # noqa: E402
from tests.runtime.test_memory import STATE_HEAVY, allocated_and_planned  # noqa: E402

CASES = [("adamw", False, 8, 8, {}), ("adamw", False, 1, 1, STATE_HEAVY),
         ("adamw", True, 1, 1, STATE_HEAVY), ("adamw", False, 2, 1, STATE_HEAVY),
         ("sgd", True, 1, 1, STATE_HEAVY), ("sgd", False, 1, 1, STATE_HEAVY)]


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
    write("allocator_memory", {"machine": machine(), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
