"""What data parallelism moves besides gradients: the all-gathers of
activations a dp2 plan makes (forward and backward), per transformers type,
for 50 types drawn (seed 5) from those the survey trains equal to eager.

An op whose SBP rule cannot keep the batch split runs whole, and the plan
gathers its inputs on every micro-batch. This counts those gathers and
their bytes from the Job alone (no run), so it measures the rule table.

    python benchmarks/dp_gathers.py [--label NAME]   # -> results/dp_gathers.json
    python benchmarks/dp_gathers.py --render         # the md from the json

Run against another meshplan (PYTHONPATH=<checkout>) with a --label to add
its column; the json keeps one column per label.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import warnings
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "dp_gathers.json"
SEED, COUNT = 5, 50
NAMED = ("llama", "esm", "mamba", "mamba2", "zamba2", "bloom", "deepseek_v2", "deepseek_v3")


def _types() -> list[str]:
    rows = json.loads((RESULTS / "hf_survey.json").read_text())["rows"]
    equal = sorted(r["type"] for r in rows if r["outcome"] == "equal")
    drawn = random.Random(SEED).sample(equal, COUNT)
    return drawn + [t for t in NAMED if t not in drawn]


def gathers(model_type: str) -> dict:
    """The dp2 Job's non-optimizer all-gathers: count and bytes."""
    from meshplan.driver.plan import plan_model, zoo_strategy
    from meshplan.ir.kinds import ALL_GATHER
    from meshplan.ir.mesh import Mesh
    from meshplan.models import model_config

    m = f"hf:{model_type}"
    cfg = model_config(m, "tiny")
    s = zoo_strategy(m, cfg, global_batch_size=4, micro_batch_size=2, dp=2)
    job = plan_model(m, "tiny", Mesh(1, 2), s, "sgd", None).job
    ops = [op for op in job.graph.ops if op.kind == ALL_GATHER and op.phase.name != "OPTIMIZER"]
    return {"gathers": len(ops),
            "bytes": sum(job.graph.values[op.refs()[0]].meta.nbytes for op in ops)}


def measure(label: str) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import meshplan

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(meshplan.__file__).parent).stdout.strip()
    col = {}
    for t in _types():
        try:
            col[t] = gathers(t)
        except Exception as e:  # noqa: BLE001 - a type this meshplan cannot plan at dp2
            col[t] = {"error": str(e).splitlines()[0][:160]}
    data = json.loads(OUT.read_text()) if OUT.exists() else {"columns": {}}
    data["columns"][label] = {"commit": commit, "types": col}
    OUT.write_text(json.dumps(data, indent=1) + "\n")


def render() -> None:
    data = json.loads(OUT.read_text())
    cols = data["columns"]
    labels = list(cols)
    lines = [f"# Activation all-gathers of a dp2 plan ({COUNT} transformers types drawn with "
             f"seed {SEED}, and {', '.join(NAMED)})",
             "", "`python benchmarks/dp_gathers.py`: per type, the forward and backward "
             "all-gathers of the dp2 Job (count, bytes per micro-batch step); optimizer "
             "gathers (ZeRO) excluded.", ""]
    summary = ["| | " + " | ".join(f"{x} ({cols[x]['commit']})" for x in labels) + " |",
               "|---|" + "---|" * len(labels)]
    for name, key in (("types gathering nothing", None), ("all-gathers", "gathers"),
                      ("bytes", "bytes")):
        vals = []
        for x in labels:
            ok = [v for v in cols[x]["types"].values() if "error" not in v]
            vals.append(sum(v[key] for v in ok) if key else
                        f"{sum(v['gathers'] == 0 for v in ok)} of {len(ok)}")
        summary.append(f"| {name} | " + " | ".join(str(v) for v in vals) + " |")
    rows = ["| type | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for t in sorted(cols[labels[0]]["types"]):
        cells = []
        for x in labels:
            v = cols[x]["types"].get(t, {})
            cells.append(v.get("error", f"{v.get('gathers')} ({v.get('bytes')} B)"))
        rows.append(f"| `{t}` | " + " | ".join(cells) + " |")
    (RESULTS / "dp_gathers.md").write_text("\n".join(lines + summary + [""] + rows) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="now")
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    if not a.render:
        measure(a.label)
    render()
