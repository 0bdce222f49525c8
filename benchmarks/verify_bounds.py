"""Where verify's bounds come from: how much of each bound a correct run uses,
and how much a wrong one does.

For GPT tiny and BERT tiny at 1 rank, tp=2, dp=2·pp=2 and dp=2·tp=2·pp=2
(ranks on threads, `runtime.local`, the runtime's own executor), in fp32,
bf16 and fp16, 5 steps of SGD and of AdamW, it runs:
- the correct plan: the share of the loss and state bounds it uses (must
  stay below 1), and eager's own reordering noise (reversed samples);
- the same plan with nothing trained (lr=0: every parameter restored after
  each STEP) and with one parameter frozen (`blocks.3.mlp.fc1.weight`):
  the share they use (must exceed 1 to be caught).

    python benchmarks/verify_bounds.py [--steps 5] [--precisions fp32,bf16,fp16]

With a subset of precisions, the rows of the others already in
results/verify_bounds.json are kept (one table over runs of the same code).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, machine, write  # noqa: E402
from meshplan.driver.compare import BOUNDS  # noqa: E402
from tests.mutations.test_mutations import freeze_one, train, train_nothing  # noqa: E402

LAYOUTS = {"1 rank": dict(global_batch_size=8, micro_batch_size=4),
           "tp2": dict(tp=2, global_batch_size=8, micro_batch_size=4),
           "dp2 pp2": dict(dp=2, pp=2, global_batch_size=8, micro_batch_size=2),
           "dp2 tp2 pp2": dict(dp=2, tp=2, pp=2, global_batch_size=8, micro_batch_size=2)}
RUNS = {"correct": None, "lr=0": train_nothing, "one frozen": freeze_one}


def used(v: dict) -> dict:
    """The largest share of a bound any loss or tensor used, and by what."""
    state = v["params"] | v["optimizer_state"]
    name, d = max(state.items(), key=lambda kv: kv[1]["bound_used"])
    return {"ok": v["ok"], "loss_used": v["loss_bound_used"], "state_used": d["bound_used"],
            "worst": name, "loss_max_abs": v["max_abs_diff"], "loss_noise": v["loss_noise"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--precisions", default="fp32,bf16,fp16")
    a = p.parse_args()
    chosen = a.precisions.split(",")
    old = RESULTS / "verify_bounds.json"
    rows = [r for r in json.loads(old.read_text())["rows"] if r["precision"] not in chosen] \
        if old.is_file() and len(chosen) < 3 else []
    t0 = time.perf_counter()
    for precision in chosen:
        for model in ("gpt", "bert"):
            for layout, fields in LAYOUTS.items():
                for optimizer in ("sgd", "adamw"):
                    for run, mutation in RUNS.items():
                        v = train(precision, run_mutation=mutation, model=model,
                                  fields=fields, optimizer=optimizer, steps=a.steps)
                        rows.append({"precision": precision, "model": model, "layout": layout,
                                     "optimizer": optimizer, "run": run, **used(v)})
                        print(rows[-1], flush=True)
    result = {"machine": machine(), "steps": a.steps, "wall_s": time.perf_counter() - t0,
              "bounds": {k: asdict(b) for k, b in BOUNDS.items()},
              "rows": rows}
    write("verify_bounds", result, table(rows, a.steps))


def table(rows: list[dict], steps: int) -> str:
    lines = [f"# verify's bounds, used ({steps} steps; `benchmarks/verify_bounds.py`)", "",
             "Share of each elementwise bound used (above 1 fails). Correct runs must",
             "stay below 1 and pass; lr=0 and one frozen parameter must fail. A wrong",
             "run under 1 here failed on another bound: bf16/fp16's update bound (the",
             "frozen tensor's update is 100% off eager's) or the loss bound.", "",
             "| precision | run | correct runs: max loss / state share | worst tensor | "
             "correct runs passing | wrong runs: min state share | caught |",
             "|---|---|---|---|---|---|---|"]
    for precision in ("fp32", "bf16", "fp16"):
        mine = [r for r in rows if r["precision"] == precision]
        good = [r for r in mine if r["run"] == "correct"]
        worst = max(good, key=lambda r: r["state_used"])
        for run in ("lr=0", "one frozen"):
            bad = [r for r in mine if r["run"] == run]
            caught = sum(not r["ok"] for r in bad)
            lines.append(f"| {precision} | {run} | {max(r['loss_used'] for r in good):.2f} / "
                         f"{worst['state_used']:.2f} | {worst['worst']} ({worst['model']} "
                         f"{worst['layout']} {worst['optimizer']}) | "
                         f"{sum(r['ok'] for r in good)}/{len(good)} | "
                         f"{min(r['state_used'] for r in bad):.1f} | {caught}/{len(bad)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
