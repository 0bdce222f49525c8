"""Tensor parallelism derived from a transformers model's structure, before
and after a change: each type's tp2 step time (`meshplan run --hf T --size
small --tp 2 --devices-per-node 2`, the median of its steps after the
first) and the plan's collectives (`meshplan plan`), at the current
checkout and at a git worktree of `--before REV`, alternately (these
machines are noisy).

Run: python benchmarks/derived_tp.py --before REV [--rounds 2] [--steps 8] [TYPE ...]
Writes benchmarks/results/derived_tp.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LAYOUT = ("--tp", "2", "--devices-per-node", "2")


def _meshplan(tree: Path, cache: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "MESHPLAN_CACHE_DIR": cache}
    return subprocess.run([sys.executable, "-m", "meshplan.cli.main", *args], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=1800, check=True)


def step_ms(tree: Path, cache: str, model_type: str, steps: int) -> float:
    out = _meshplan(tree, cache, "run", "--hf", model_type, "--size", "small", *LAYOUT,
                    "--steps", str(steps), "--json")
    return 1e3 * statistics.median(json.loads(out.stdout)["step_s"][1:])


def collectives(tree: Path, cache: str, model_type: str) -> dict:
    """The plan's collectives over tp by (kind, phase), and its per-step
    count and logical MiB (`meshplan plan`)."""
    text = _meshplan(tree, cache, "plan", "--hf", model_type, "--size", "small",
                     *LAYOUT).stdout
    kinds = {f"{k} {ph}": int(c) for k, ph, c in
             re.findall(r"(\w+) over tp \((forward|backward)\)\s+(\d+)", text)}
    ops, size, unit = re.search(r"per step: (\d+) communication ops, ([\d.]+) (MiB|KiB)",
                                text).groups()
    return {"kinds": kinds, "ops": int(ops),
            "mib": float(size) / (1024 if unit == "KiB" else 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the git revision to compare with")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("types", nargs="*", default=["bert", "distilbert", "bart"])
    args = p.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
    res = {"machine": common.machine(), "before": args.before, "after": head,
           "steps": args.steps, "types": {}}
    with tempfile.TemporaryDirectory() as folder:
        old = Path(folder) / "before"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(old), args.before],
                       cwd=ROOT, check=True)
        trees = {"before": old, "after": ROOT}
        caches = {k: str(Path(folder) / f"cache-{k}") for k in trees}
        try:
            for t in args.types:
                row: dict = {k: {"step_ms": []} for k in trees}
                for k in trees:
                    row[k]["plan"] = collectives(trees[k], caches[k], t)
                for r in range(args.rounds):
                    for k in (("before", "after") if r % 2 == 0 else ("after", "before")):
                        row[k]["step_ms"].append(step_ms(trees[k], caches[k], t, args.steps))
                res["types"][t] = row
                print(t, json.dumps(row), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "derived_tp.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# Tensor parallelism derived from a model's structure, before and after", "",
             f"Before: {res['before']}; after: {res['after']}. Machine: {res['machine']}. "
             f"`meshplan run --hf T --size small {' '.join(LAYOUT)} --steps {args.steps}`: "
             "the median step after the first, per run; runs alternate. Collectives per step "
             "and their logical MiB from `meshplan plan`.", "",
             "| type | collectives (MiB) before | after | step ms before (runs) | after (runs) | "
             "after / before |", "|---|---|---|---|---|---|"]
    for t, row in res["types"].items():
        b, a = row["before"], row["after"]
        mb, ma = statistics.median(b["step_ms"]), statistics.median(a["step_ms"])
        lines.append(f"| {t} | {b['plan']['ops']} ({b['plan']['mib']:.1f}) | "
                     f"{a['plan']['ops']} ({a['plan']['mib']:.1f}) | "
                     f"{', '.join(f'{x:.0f}' for x in b['step_ms'])} | "
                     f"{', '.join(f'{x:.0f}' for x in a['step_ms'])} | {ma / mb:.2f} |")
    (RESULTS / "derived_tp.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
