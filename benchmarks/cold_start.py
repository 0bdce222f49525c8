"""A cold Inductor cache, before and after a change: `meshplan run --steps 2
--kernels inductor` of GPT tiny at the demo's layout (dp2 tp2 pp2 vpp2, 8
processes) and at pp2 (2 processes, 4 micro-batches), each run in fresh
processes with an empty cache folder, from this checkout ("after") and from
a git worktree of `--before REV`, alternately (these machines are noisy).

It measured:
- the step-0 rehearsal (docs/concepts/kernels.md: the first step runs eager
  kernels, the second starts by building every run, all ranks at once)
  against the build at each run's first call, inside the first step:
  `--before 680de16` (results/cold_start.md);
- helper processes building a rank's runs on the spare cores, at one
  process (2 cores: one helper): `--before 611ca56 --layouts 1p --name
  cold_start_helpers` (results/cold_start_helpers.md).

Run: python benchmarks/cold_start.py --before REV [--rounds 1] [--layouts demo,pp2,1p]
     [--name cold_start]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from fused import COLD, DEMO  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"demo": ("gpt tiny, dp2 tp2 pp2 vpp2 (the demo's)", DEMO),
           "pp2": ("gpt tiny, pp2, 4 micro-batches", COLD["gpt tiny, pp2, 4 micro-batches"]),
           "1p": ("gpt tiny, 1 process, AdamW", COLD["gpt tiny, 1 process, AdamW"])}


def cold_run(tree: Path, layout: list[str]) -> dict:
    """`meshplan run` from the source tree `tree`, with an empty cache folder."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(tree)}
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "meshplan", "run", "--model", "gpt",
                            "--size", "tiny", *layout, "--steps", "2", "--kernels", "inductor",
                            "--timeout", "900", "--json"], capture_output=True, text=True,
                           cwd=tree, env=env, timeout=1800)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-2000:])
        res = json.loads(p.stdout)
        return {"wall_s": round(wall, 1), "losses": res["losses"],
                "kernel_compile_s": sorted(round(r.get("kernel_compile_s", 0.0), 1)
                                           for r in res["ranks"].values()),
                "packages": len(list(Path(cache).glob("meshplan-aot/*.pt2")))}


def table(res: dict) -> str:
    lines = ["# A cold Inductor cache, before and after", "",
             f"Machine: {res['machine']['cpu_count']} CPUs, torch {res['machine']['torch']}. "
             f"Before: {res['before']}; after: {res['after']}. `meshplan run --steps 2 "
             "--kernels inductor`, fresh processes, an empty cache folder each run.", "",
             "| layout | before: wall (s) | after: wall (s) | after / before | build s per rank "
             "(before; after) | packages | same losses |", "|---|---|---|---|---|---|---|"]
    for name, r in res["layouts"].items():
        b, a = r["before"], r["after"]
        wb, wa = common.median([x["wall_s"] for x in b]), common.median([x["wall_s"] for x in a])
        same = all(x["losses"] == b[0]["losses"] for x in a + b)
        lines.append(f"| {name} | {wb:.1f} | {wa:.1f} | {wa / wb:.2f} | "
                     f"{min(b[0]['kernel_compile_s'])}-{max(b[0]['kernel_compile_s'])}; "
                     f"{min(a[0]['kernel_compile_s'])}-{max(a[0]['kernel_compile_s'])} | "
                     f"{a[0]['packages']} | {'yes' if same else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the git revision to compare with")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--layouts", default="demo,pp2", help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--name", default="cold_start", help="the results' file name")
    args = p.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT, check=True).stdout.strip()
    res = {"machine": common.machine(), "before": args.before, "after": head, "layouts": {}}
    with tempfile.TemporaryDirectory() as folder:
        old = Path(folder) / "before"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(old), args.before],
                       cwd=ROOT, check=True)
        try:
            for name, layout in (LAYOUTS[k] for k in args.layouts.split(",")):
                runs: dict[str, list] = {"before": [], "after": []}
                for k in range(args.rounds):
                    for which in (("before", "after") if k % 2 == 0 else ("after", "before")):
                        common.wait_quiet(30)
                        runs[which].append(cold_run(old if which == "before" else ROOT, layout))
                res["layouts"][name] = runs
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)
    common.write(args.name, res, table(res))


if __name__ == "__main__":
    main()
