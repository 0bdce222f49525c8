"""The main job as a user runs it: `meshplan train` with no arguments, timed
from the command to its last line, the standard library's data prepared on
first use included (a fresh `MESHPLAN_HOME`).

Records the wall time, the evaluation loss before and after (and how far it
fell: target >= 40%), the training split's unigram entropy (the eval loss
should end below it), the median tokens/s and MFU, and the sample; copies
`loss.png` to docs/concepts/img/train_loss.png for the README.

Run: python benchmarks/main_job.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, write  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="meshplan-main-job-") as tmp:
        env = os.environ | {"MESHPLAN_HOME": str(Path(tmp) / "home")}
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "meshplan", "-q", "train", "--json"],
                           cwd=tmp, env=env, capture_output=True, text=True, check=True)
        wall_s = time.perf_counter() - t0
        summary = json.loads(p.stdout)
        img = ROOT / "docs" / "concepts" / "img" / "train_loss.png"
        shutil.copyfile(Path(tmp) / "meshplan-train" / "loss.png", img)
    (k0, e0), (k1, e1) = summary["evals"][0], summary["evals"][-1]
    result = {"machine": machine(), "command": "meshplan train", "wall_s": wall_s,
              "train_s": summary["wall_s"], "steps": summary["steps"],
              "first_loss": summary["losses"][0], "last_loss": summary["losses"][-1],
              "eval_first": [k0, e0], "eval_last": [k1, e1], "eval_drop": 1 - e1 / e0,
              "unigram_entropy": summary["unigram_entropy"],
              "tokens_per_s": summary["tokens_per_s"], "mfu": summary["mfu"],
              "mfu_of": summary["mfu_of"], "sample": summary.get("sample")}
    table = (
        "The main job, `meshplan train` with no arguments (GPT small, dp2 tp2 pp2 vpp2 on 8 "
        "local processes, the standard library's sources as byte tokens, prepared on first "
        "use), timed from the command to its last line.\n\n"
        "| wall (s) | steps | eval loss, step 0 | eval loss, last | fell | unigram entropy "
        "| tokens/s | MFU |\n|---|---|---|---|---|---|---|---|\n"
        f"| {wall_s:.0f} | {result['steps']} | {e0:.4f} | {e1:.4f} (step {k1}) "
        f"| {result['eval_drop']:.0%} | {result['unigram_entropy']:.4f} "
        f"| {result['tokens_per_s']:.0f} | {result['mfu']:.1%} of {result['mfu_of']}'s peak |\n")
    write("main_job", result, table)


if __name__ == "__main__":
    main()
