"""The dispatch of one measured step, drawn (docs/concepts/img/moe_step.png).

Setup: the zoo's MoE small (8 layers, hidden 256, seq 128, 8 experts,
top-2, dropless) at dp=2 ep=2 on 2 gloo processes over 127.0.0.1, CPU,
SGD; `meshplan run --steps 3 --trace --json`, as a user runs it.

Drawn from what that run measured, its last step:
- left, per rank: the schedule's actions (F, B, STEP) and every collective
  span of the step, the all-to-alls (each block's dispatch and combine,
  and their gradients) in colour, the other collectives the step waits on
  grey (those that run in the background across it, the gradient buckets
  and deferred reductions, are not drawn);
- right: the tokens each block's router sent each expert in that step (the
  `tokens_per_expert` reports, summed over both ranks), and which rank
  holds each expert (ep=2: experts 0-3 on the first rank of the ep line,
  4-7 on the second).

Run: python benchmarks/moe_dispatch_picture.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import wait_quiet  # noqa: E402

PNG = Path(__file__).resolve().parent.parent / "docs" / "concepts" / "img" / "moe_step.png"
CMD = [sys.executable, "-m", "meshplan", "run", "--model", "moe", "--size", "small",
       "--devices-per-node", "2", "--ep", "2", "--global-batch-size", "4",
       "--micro-batch-size", "2", "--optimizer", "sgd", "--steps", "3"]
A2A, OTHER, ACTION = "#D55E00", "#BBBBBB", "#0072B2"
# collectives that run in the background, across the step (not drawn)
BACKGROUND = ("deferred", "early", "bucket", "wait sends")


def measured(folder: str) -> tuple[dict, dict]:
    """(the last step's Chrome trace, the run's JSON)."""
    wait_quiet()
    trace = Path(folder, "trace.json")
    out = subprocess.run([*CMD, "--trace", str(trace), "--json"], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(trace.read_text()), json.loads(out)


def _colour(e: dict) -> str:
    if e["name"].startswith("all_to_all"):
        return A2A
    return OTHER if e.get("tid") == 1 else ACTION


def draw(trace: dict, run: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and not
             any(w in e["name"] for w in BACKGROUND)]
    t0 = min(e["ts"] for e in spans)
    fig, (ax, hx) = plt.subplots(1, 2, figsize=(13, 3.8), width_ratios=(3, 1))
    for e in spans:
        x, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        y = e["pid"] + (0.05 if e.get("tid") == 1 else -0.3)
        ax.broken_barh([(x, w)], (y, 0.25), color=_colour(e), edgecolor="white")
        if e.get("tid") == 0 and w > 40:
            ax.text(x + w / 2, y + 0.125, e["name"].lstrip("0123456789"), ha="center",
                    va="center", fontsize=7, color="white")
    ranks = sorted({e["pid"] for e in spans})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms in the step")
    n_a2a = sum(1 for e in spans if e["name"].startswith("all_to_all")) // len(ranks)
    ax.set_title(f"zoo MoE small, dp=2 ep=2, gloo on CPU: one measured step ({n_a2a} "
                 "all-to-alls a rank)", fontsize=9)
    ax.legend(handles=[Patch(color=ACTION, label="action (F, B, STEP)"),
                       Patch(color=A2A, label="all-to-all: tokens to their experts and back "
                                             "(and their gradients)"),
                       Patch(color=OTHER, label="other collectives (those in the "
                                               "background not drawn)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8,
              frameon=False)
    load = run["reports"]  # report -> one row per step
    blocks = sorted((k for k in load if k.startswith("tokens_per_expert/")),
                    key=lambda k: int(k.split(".")[-2]))
    grid = [load[b][-1] for b in blocks]
    im = hx.imshow(grid, cmap="Blues", aspect="auto")
    experts = len(grid[0])
    hx.set_xticks(range(experts), [f"{e}\nr{e * 2 // experts}" for e in range(experts)],
                  fontsize=7)
    hx.set_yticks(range(len(blocks)), [b.split("/")[1] for b in blocks], fontsize=7)
    hx.set_xlabel("expert, and the ep rank holding it", fontsize=8)
    hx.set_title("tokens sent to each expert, that step", fontsize=9)
    fig.colorbar(im, ax=hx, fraction=0.05)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="moe-picture-") as folder:
        trace, run = measured(folder)
    draw(trace, run, PNG)
    print(f"wrote {PNG}")


if __name__ == "__main__":
    main()
