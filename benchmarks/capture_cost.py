"""What capture costs since mutation is functionalized by torch and the
captured forward checks itself (issue 29), against the capture before.

Both trees run in fresh processes, alternating, round after round (the
machine is shared): the tree before the change (`--base`, checked out with
`git worktree`) and this one. In each process, for one model:
- `api` is `mp.capture(module, batch)` on real weights, the path a user of
  the Python API takes: torch.export, functionalization where the program
  mutates, translation, and in this tree the self-check; `first` is the
  process's first call (what a user pays), `again` a second one;
- `nocheck` (this tree only) the same call with `self_check=False`, and
  `check` the self-check alone (`check_capture` on a finished capture);
- `zoo` is the CLI's capture (`capture_zoo`: on the meta device, no cache),
  which has no weights to check.
Target (issue 29): this tree's first `api` capture of every transformers
model the project tests within 1.2x of the base tree's.

`python benchmarks/capture_cost.py [--rounds 3] [--base REV] [--name NAME]`:
results in `benchmarks/results/NAME.{json,md}` (default `capture_cost`; the
gradient self-check's against the tree before it: `--base d2d65b1 --name
capture_cost_grads`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import alternate, machine, median, write  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASE = "64c2fe6"  # main before issue 29: the hand-written functionalization, no self-check
# (model, size, micro-batch): the transformers models the tests train, the
# zoo's GPT small, and its biggest model a CPU trains in reasonable time.
MODELS = [("hf:gpt2", "tiny", 8), ("hf:bert", "tiny", 8), ("hf:llama", "tiny", 8),
          ("gpt", "small", 8), ("resnet", "resnet50", 2)]
TRANSFORMERS = {"hf:gpt2", "hf:bert", "hf:llama"}

PROBE = r"""
import inspect, json, sys, time, torch
import meshplan.api as mp
from meshplan.driver.plan import capture_zoo
from meshplan.models import build_model, example_batch, model_config
model, size, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
cfg = model_config(model, size)
module, data = build_model(cfg), example_batch(cfg, batch)
def timed(**kw):
    t0 = time.perf_counter(); g = mp.capture(module, data, **kw)
    return time.perf_counter() - t0, len(g.ops)
out = {}
out["first"], out["ops"] = timed()
out["again"], _ = timed()
if "self_check" in inspect.signature(mp.capture).parameters:
    from meshplan.capture.export import trace
    from meshplan.driver.capture_check import check_capture
    out["nocheck"], _ = timed(self_check=False)
    traced = trace(module, data)
    t0 = time.perf_counter(); check_capture(traced, module, data)
    out["check"] = time.perf_counter() - t0
t0 = time.perf_counter(); capture_zoo(cfg, batch, use_cache=False)
out["zoo"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def probe(tree: Path, model: str, size: str, batch: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", PROBE, model, size, str(batch)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=tree)
    if p.returncode:
        raise SystemExit(f"{model} in {tree}: {p.stderr.strip().splitlines()[-1]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", default=BASE)
    ap.add_argument("--name", default="capture_cost")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="meshplan-base-"))
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), args.base],
                   cwd=ROOT, check=True)
    try:
        result = {"machine": machine(), "base": args.base, "rounds": args.rounds, "models": {}}
        for model, size, batch in MODELS:
            case = (model, size, batch)
            runs = alternate({"base": lambda case=case: probe(base, *case),
                              "head": lambda case=case: probe(ROOT, *case)}, args.rounds)
            row = {tree: {k: median([r[k] for r in v["rounds"]]) for k in v["rounds"][0]}
                   for tree, v in runs.items()}
            row["ratio_first"] = row["head"]["first"] / row["base"]["first"]
            row["ratio_again"] = row["head"]["again"] / row["base"]["again"]
            row["self_check_s"] = row["head"]["check"]
            row["raw"] = runs
            result["models"][f"{model} {size} b{batch}"] = row
            print(model, json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    write(args.name, result, table(result))


def table(result: dict) -> str:
    lines = [f"# Capture cost: this tree against `{result['base']}`", "",
             f"Medians of {result['rounds']} alternating rounds, a fresh process each, "
             f"against main at `{result['base']}`; seconds.", "",
             "| model | ops | base first | first | ratio | base again | again | ratio "
             "| self-check | zoo (meta) base | zoo (meta) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["models"].items():
        b, h = r["base"], r["head"]
        lines.append(f"| {name} | {h['ops']} | {b['first']:.2f} | {h['first']:.2f} | "
                     f"{r['ratio_first']:.2f} | {b['again']:.2f} | {h['again']:.2f} | "
                     f"{r['ratio_again']:.2f} | {r['self_check_s']:.3f} | {b['zoo']:.2f} | "
                     f"{h['zoo']:.2f} |")
    ok = all(r["ratio_first"] <= 1.2 for n, r in result["models"].items()
             if n.split()[0] in TRANSFORMERS)
    others = ", ".join(f"{n} {r['ratio_first']:.2f}x" for n, r in result["models"].items()
                       if n.split()[0] not in TRANSFORMERS)
    lines += ["", f"Target: transformers models' first capture within 1.2x: "
              f"{'met' if ok else 'NOT met'}. Beyond it (no target): {others}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
