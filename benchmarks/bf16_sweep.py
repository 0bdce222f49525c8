"""Every tested transformers type (`models/hf.TESTED`) under bf16 AdamW:
`meshplan verify --hf T --precision bf16 --optimizer adamw --steps 2`, at
one rank or at a layout, judged against eager `torch.autocast`
(docs/concepts/verify.md).

Each type runs in its own process, as a user runs it. Writes
`benchmarks/results/bf16_sweep[_LAYOUT].json` and `.md`: per type EQUAL,
MISMATCH (the tensors named), REFUSED (meshplan's one line, exit 2: a
user's mistake or an unsupported layout) or ERROR (anything else: its
last line). Types named on the command line replace their rows of the
results already there; no types: every tested type, the files anew.

    python benchmarks/bf16_sweep.py [--layout tp2|dp2pp2|...] [TYPE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from meshplan.models.hf import TESTED

RESULTS = Path(__file__).parent / "results"
ARGS = ("--precision", "bf16", "--optimizer", "adamw", "--steps", "2")
LAYOUTS = {"1": (), "tp2": ("--tp", "2", "--devices-per-node", "2"),
           "dp2pp2": ("--dp", "2", "--pp", "2", "--devices-per-node", "4"),
           "dp2zero3": ("--dp", "2", "--zero", "3", "--devices-per-node", "2")}


def verdict(model_type: str, layout: tuple[str, ...], cache: str) -> dict:
    """One type's verdict, from its own `meshplan verify` process."""
    run = subprocess.run([sys.executable, "-m", "meshplan.cli.main", "verify", "--hf",
                          model_type, *ARGS, *layout, "--json"], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "MESHPLAN_CACHE_DIR": cache})
    try:
        d = json.loads(run.stdout)
    except json.JSONDecodeError:
        lines = run.stderr.strip().splitlines()
        return {"type": model_type, "result": "REFUSED" if run.returncode == 2 else "ERROR",
                "detail": lines[-1] if lines else ""}
    return {"type": model_type, "result": "EQUAL" if d["ok"] else "MISMATCH",
            "max_abs_diff": d["max_abs_diff"], "detail": "; ".join(d["problems"][:2])}


def main(types: list[str], layout: str, update: bool) -> None:
    args = (*ARGS, *LAYOUTS[layout])
    name = "bf16_sweep" if layout == "1" else f"bf16_sweep_{layout}"
    old = RESULTS / f"{name}.json"
    rows = json.loads(old.read_text()) if update and old.exists() else []
    with tempfile.TemporaryDirectory() as cache:
        for t in types:
            row = verdict(t, LAYOUTS[layout], cache)
            at = next((i for i, r in enumerate(rows) if r["type"] == t), len(rows))
            rows[at:at + 1] = [row]
            print(row["result"], t, row.get("detail", "")[:120], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    equal = sum(r["result"] == "EQUAL" for r in rows)
    where = "one rank" if layout == "1" else layout
    lines = [f"# bf16 AdamW at {where}: {equal} of {len(rows)} tested types equal to eager "
             "autocast", "", f"`meshplan verify --hf T {' '.join(args)}`, each type in its "
             "own process (`benchmarks/bf16_sweep.py`).", "",
             "| type | verdict | max loss diff | detail |", "|---|---|---|---|"]
    lines += [f"| {r['type']} | {r['result']} | "
              f"{r['max_abs_diff']:.1e} | {r['detail'][:150]} |" if "max_abs_diff" in r else
              f"| {r['type']} | {r['result']} | | {r['detail'][:150]} |" for r in rows]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="1")
    ap.add_argument("types", nargs="*")
    a = ap.parse_args()
    main(a.types or list(TESTED), a.layout, update=bool(a.types))
