"""Every tested transformers type (`models/hf.TESTED`) under bf16 AdamW at
one rank: `meshplan verify --hf T --precision bf16 --optimizer adamw
--steps 2`, judged against eager `torch.autocast` (docs/concepts/verify.md).

Each type runs in its own process, as a user runs it. Writes
`benchmarks/results/bf16_sweep.json` and `.md`: per type EQUAL, MISMATCH
(the tensors named) or ERROR (the error's line).

    python benchmarks/bf16_sweep.py [TYPE ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from meshplan.models.hf import TESTED

RESULTS = Path(__file__).parent / "results"
ARGS = ("--precision", "bf16", "--optimizer", "adamw", "--steps", "2")


def verdict(model_type: str, cache: str) -> dict:
    """One type's verdict, from its own `meshplan verify` process."""
    run = subprocess.run([sys.executable, "-m", "meshplan.cli.main", "verify", "--hf",
                          model_type, *ARGS, "--json"], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "MESHPLAN_CACHE_DIR": cache})
    try:
        d = json.loads(run.stdout)
    except json.JSONDecodeError:
        lines = run.stderr.strip().splitlines()
        return {"type": model_type, "result": "ERROR", "detail": lines[-1] if lines else ""}
    return {"type": model_type, "result": "EQUAL" if d["ok"] else "MISMATCH",
            "max_abs_diff": d["max_abs_diff"], "detail": "; ".join(d["problems"][:2])}


def main(types: list[str]) -> None:
    with tempfile.TemporaryDirectory() as cache:
        rows = []
        for t in types:
            rows.append(verdict(t, cache))
            print(rows[-1]["result"], t, rows[-1].get("detail", "")[:120], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bf16_sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    equal = sum(r["result"] == "EQUAL" for r in rows)
    lines = [f"# bf16 AdamW at one rank: {equal} of {len(rows)} tested types equal to eager "
             "autocast", "", f"`meshplan verify --hf T {' '.join(ARGS)}`, each type in its "
             "own process (`benchmarks/bf16_sweep.py`).", "",
             "| type | verdict | max loss diff | detail |", "|---|---|---|---|"]
    lines += [f"| {r['type']} | {r['result']} | "
              f"{r['max_abs_diff']:.1e} | {r['detail'][:150]} |" if "max_abs_diff" in r else
              f"| {r['type']} | {r['result']} | | {r['detail'][:150]} |" for r in rows]
    (RESULTS / "bf16_sweep.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:] or list(TESTED))
