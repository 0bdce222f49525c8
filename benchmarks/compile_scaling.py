"""Compile scaling: how planning time grows with the model and the cluster.

Section 1 (planning passes): GPT-3 175B (96 layers, hidden 12288, 96 heads,
seq 2048, vocab 50304) on tp=8, pp=16, vpp=2, 64 micro-batches, for dp in
{1, 4, 8, 32} (world 128 ... 4096). Capture runs once (meta device, no
weights); the passes run per world size. Target: passes <= 1 s at 1024 ranks.

Run: python benchmarks/compile_scaling.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write  # noqa: E402

from meshplan.autodiff import build_train_step  # noqa: E402
from meshplan.capture import capture  # noqa: E402
from meshplan.driver.plan import zoo_strategy  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.models import build_model, example_batch, model_config  # noqa: E402
from meshplan.passes.plan import plan_job  # noqa: E402


def planning_rows() -> tuple[float, list[dict]]:
    cfg = model_config("gpt", "gpt3-175b")
    t0 = time.perf_counter()
    graph = capture(build_model(cfg, device="meta"), example_batch(cfg, 1, device="meta"))
    capture_s = time.perf_counter() - t0
    rows = []
    for dp in (1, 4, 8, 32):
        world = dp * 8 * 16
        s = zoo_strategy("gpt", cfg, dp=dp, tp=8, pp=16, vpp=2,
                         global_batch_size=64 * dp, micro_batch_size=1)
        t1 = time.perf_counter()
        step = build_train_step(graph, num_microbatches=s.num_microbatches)
        autodiff_s = time.perf_counter() - t1
        best, timings = None, {}
        for _ in range(3):
            t = {}
            t2 = time.perf_counter()
            job = plan_job(step, Mesh(world // 8, 8), s, timings=t)
            elapsed = time.perf_counter() - t2
            if best is None or elapsed < best:
                best, timings = elapsed, t
        rows.append({"world": world, "dp": dp, "ops": len(job.graph.ops),
                     "autodiff_s": autodiff_s, "passes_s": best,
                     "per_pass_s": timings})
    return capture_s, rows


def main() -> None:
    capture_s, rows = planning_rows()
    result = {"benchmark": "compile_scaling", "machine": machine(),
              "model": "gpt3-175b", "capture_s": capture_s,
              "planning": {"target_passes_s_at_1024": 1.0, "rows": rows}}
    lines = [f"GPT-3 175B planning passes (capture once: {capture_s:.1f} s on the meta "
             "device), tp=8 pp=16 vpp=2, 64 micro-batches; best of 3.", "",
             "| world | dp | ops in Job | autodiff (s) | passes (s) | propagate_sbp (s) "
             "| add_boxing (s) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["per_pass_s"]
        lines.append(f"| {r['world']} | {r['dp']} | {r['ops']} | {r['autodiff_s']:.2f} | "
                     f"{r['passes_s']:.3f} | {p['propagate_sbp']:.3f} | {p['add_boxing']:.3f} |")
    write("compile_scaling", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
