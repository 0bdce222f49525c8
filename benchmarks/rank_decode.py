"""What a training rank decodes of the Job before its first step: its
stage's view (`JobReader.view`, what `runtime/worker.py` reads since issue
33) against the whole Job (`Job.from_bytes`, what it read before), on
GPT-3 175B at tp8 pp16 vpp2 (128 ranks), the Job bytes a rank receives.
Alternating runs, 3 of each per stage sampled (first, middle, last); the
time is the decode alone, from the bytes in memory (hash check included).

    python benchmarks/rank_decode.py   # ~2 min on 2 cores (planning the Job)

Writes benchmarks/results/rank_decode.{json,md}.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPS = 3


def main() -> None:
    from meshplan.driver.plan import plan_model, zoo_strategy
    from meshplan.ir.job import Job, JobReader
    from meshplan.ir.mesh import Mesh
    from meshplan.models import model_config
    from meshplan.runtime.comm import rank_groups

    cfg = model_config("gpt", "gpt3-175b")
    s = zoo_strategy("gpt", cfg, tp=8, pp=16, vpp=2, dp=1, global_batch_size=64,
                     micro_batch_size=1, schedule="interleaved")
    data = plan_model("gpt", "gpt3-175b", Mesh(16, 8), s, "adamw").job.to_bytes()
    rows = []
    for stage in (0, s.pp // 2, s.pp - 1):
        rank = s.ranks_of_stage(stage)[0]
        whole, view = [], []
        for _ in range(REPS):  # alternating
            t0 = time.perf_counter()
            Job.from_bytes(data)
            whole.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            v = JobReader(data).view(stage)
            rank_groups(v.strategy, rank, v.ops)
            view.append(time.perf_counter() - t0)
        rows.append({"stage": stage, "rank": rank, "whole_job_s": statistics.median(whole),
                     "stage_view_s": statistics.median(view),
                     "ratio": statistics.median(view) / statistics.median(whole)})
    out = {"model": "gpt3-175b", "strategy": "tp8 pp16 vpp2 dp1 (128 ranks)",
           "job_bytes": len(data), "reps": REPS, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rank_decode.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = ["# What a rank decodes of the Job (benchmarks/rank_decode.py)", "",
             f"GPT-3 175B, {out['strategy']}, Job {len(data) / 1e6:.1f} MB; median of "
             f"{REPS} alternating runs, seconds.", "",
             "| stage | whole Job (before) | its stage's view + its groups (now) | ratio |",
             "|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['whole_job_s']:.3f} | {r['stage_view_s']:.3f} | "
              f"{r['ratio']:.3f} |" for r in rows]
    (RESULTS / "rank_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
