"""Recompute and mixed precision: planned and measured memory, step time.

GPT small, pp=2 (1F1B), 8 micro-batches of 1, SGD, gloo, 1 thread per rank,
for each (precision, recompute). Ratios are against fp32 without recompute,
measured in the same run. Planned numbers come from `lower(job, rank)`;
measured ones from the ranks' LiveBytes, step times are the median of the
steps after the first.

    python benchmarks/step_memory.py [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, write  # noqa: E402
from meshplan.driver.plan import plan_model, zoo_strategy  # noqa: E402
from meshplan.driver.run import run  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.lowering.lower import lower  # noqa: E402
from meshplan.models import model_config  # noqa: E402

CONFIGS = [("fp32", "none"), ("fp32", "selective"), ("fp32", "full"), ("bf16", "none"),
           ("bf16", "full")]
MiB = 2 ** 20


def measure(precision: str, recompute: str, steps: int) -> dict:
    cfg = model_config("gpt", "small")
    s = zoo_strategy("gpt", cfg, pp=2, global_batch_size=8, micro_batch_size=1,
                     precision=precision, recompute=recompute)
    mesh = Mesh(1, 2)
    job = plan_model("gpt", "small", mesh, s).job
    planned = [dict(lower(job, r).memory.peak) for r in range(mesh.world)]
    r = run("gpt", "small", mesh, s, steps=steps)
    return {
        "precision": precision, "recompute": recompute, "ops": len(job.graph.ops),
        "planned_activation": [p["activation"] for p in planned],
        "planned_total": [p["total"] for p in planned],
        "measured_peak": [v["measured_peak_bytes"] for v in r["ranks"].values()],
        "step_s": statistics.median(r["step_s"][1:]), "losses": r["losses"],
    }


def table(rows: list[dict]) -> str:
    base = rows[0]
    out = ["| precision | recompute | planned activation per rank (MiB) | vs fp32/none | "
           "measured peak per rank (MiB) | step (ms) | vs fp32/none |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        act = " / ".join(f"{a / MiB:.1f}" for a in r["planned_activation"])
        ratio = max(r["planned_activation"]) / max(base["planned_activation"])
        meas = " / ".join(f"{m / MiB:.1f}" for m in r["measured_peak"])
        out.append(f"| {r['precision']} | {r['recompute']} | {act} | {ratio:.2f} | {meas} | "
                   f"{r['step_s'] * 1e3:.0f} | {r['step_s'] / base['step_s']:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    rows = [measure(p, rc, a.steps) for p, rc in CONFIGS]
    write("step_memory", {"machine": machine(), "model": "gpt small", "pp": 2,
                          "num_microbatches": 8, "rows": rows}, table(rows))


if __name__ == "__main__":
    main()
