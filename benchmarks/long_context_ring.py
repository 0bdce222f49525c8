"""Ring attention (issue 37, `--cp-attention ring`) measured: its step
against the all-gather form's, its load balance in a measured trace, and a
picture of the ring in one measured step.

Setup: GPT small (8 layers, hidden 256, 8 heads, vocab 1024) at seq 2048,
one sample a step, SGD, fp32, CPU, gloo over 127.0.0.1, cp=2 on 2
processes (this machine has 2 cores: cp4's 4 processes would time each
other's contention, not their work), one thread a rank.

Three parts, one run:
1. speed: `meshplan run --json` as a user runs it, cp2 with the ring and
   with the all-gather form, 3 steps, rounds alternating once the CPUs are
   quiet; the step (median of the steps after the first) and the losses.
2. balance: `meshplan run --trace`, the ring, causal, load-balanced and in
   order: each rank's measured seconds in its ring blocks (the attention
   kernels' spans in the last step's trace, forward and backward), max over
   min, against the plan's attention flops per rank (max over min).
3. picture: the balanced trace drawn, one row per rank: its actions, each
   ring block it computes (coloured by the rank whose keys it holds), and
   each shift of keys and values (or their gradients) in flight.

Targets: the ring's losses equal the all-gather form's; balanced, the
measured per-rank attention time within 10% (the plan's within 5%).

Run: python benchmarks/long_context_ring.py [--rounds R] [--picture PNG]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, wait_quiet, write  # noqa: E402

from meshplan.costmodel import load_device_model  # noqa: E402
from meshplan.driver.plan import plan_model, zoo_strategy  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.lowering.action_times import attention_flops  # noqa: E402
from meshplan.lowering.lower import lower  # noqa: E402
from meshplan.models import model_config  # noqa: E402

SEQ, CP = 2048, 2
PNG = Path(__file__).resolve().parent.parent / "docs" / "concepts" / "img" / "ring_step.png"


def _cmd(form: str, *more: str) -> list[str]:
    return [sys.executable, "-m", "meshplan", "run", "--model", "gpt", "--size", "small",
            "--seq-len", str(SEQ), "--devices-per-node", str(CP), "--cp", str(CP),
            "--cp-attention", form, "--global-batch-size", "1", "--micro-batch-size", "1",
            "--optimizer", "sgd", "--steps", "3", *more]


def speed(form: str) -> dict:
    wait_quiet()
    got = json.loads(subprocess.run(_cmd(form, "--json"), capture_output=True, text=True,
                                    check=True).stdout)
    return {"step_s": median(got["step_s"][1:]), "losses": got["losses"]}


def traced(balance: bool, path: str) -> dict:
    """Each rank's seconds in its ring blocks in the last step, measured."""
    wait_quiet()
    subprocess.run(_cmd("ring", "--trace", path, *(() if balance else ("--no-cp-balance",))),
                   capture_output=True, text=True, check=True)
    per: dict[int, float] = defaultdict(float)
    for e in json.loads(Path(path).read_text())["traceEvents"]:
        if e.get("ph") == "X" and e["name"].startswith("ring") and " block " in e["name"]:
            per[e["pid"]] += e["dur"] / 1e6
    return dict(sorted(per.items()))


def planned(balance: bool) -> list[float]:
    cfg = model_config("gpt", "small", seq_len=SEQ)
    s = zoo_strategy("gpt", cfg, global_batch_size=1, micro_batch_size=1, cp=CP,
                     cp_balance=balance, cp_attention="ring")
    job = plan_model("gpt", "small", Mesh(1, CP), s, "sgd", None, seq_len=SEQ).job
    dev = load_device_model("h100-80gb")
    return [attention_flops(job, lower(job, r), dev) for r in range(CP)]


# lane -> (offset from the rank's row, colour or None: by source rank, legend)
LANES = {"action": (-0.45, "#BBBBBB", "action: F forward, B backward, STEP"),
         "block": (-0.2, None, ""),
         "shift": (0.05, "#D55E00", "ring shift in flight: keys and values (and, backward, "
                                    "their gradients) to the next rank")}
SOURCES = ("#0072B2", "#009E73", "#CC79A7", "#E69F00")


def _lane(e: dict) -> str | None:
    if e["name"].startswith("ring shift"):
        return "shift"
    if e["name"].startswith("ring") and " block " in e["name"]:
        return "block"
    return "action" if e.get("cat") == "compute" else None


def draw(trace: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and _lane(e)]
    fig, ax = plt.subplots(figsize=(12, 3.6))
    for e in spans:
        lane = _lane(e)
        offset, colour, _ = LANES[lane]
        if lane == "block":
            colour = SOURCES[int(e["name"].rsplit(" ", 1)[1]) % len(SOURCES)]
        x, w = e["ts"] / 1e3, e["dur"] / 1e3
        ax.broken_barh([(x, w)], (e["pid"] + offset, 0.22), color=colour,
                       alpha=0.45 if lane == "shift" else 1.0,
                       edgecolor="white" if lane != "shift" else "none")
        if lane == "action" and w > 20:
            ax.text(x + w / 2, e["pid"] + offset + 0.11, e["name"].lstrip("0123456789"),
                    ha="center", va="center", fontsize=7)
    ranks = sorted({e["pid"] for e in spans})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the barrier before the step")
    ax.set_title(f"meshplan ring attention, GPT small at seq {SEQ}, cp={CP} (load-balanced), "
                 "gloo on CPU: one measured step", fontsize=9)
    handles = [Patch(color=c, label=label) for _, c, label in LANES.values() if c]
    handles += [Patch(color=SOURCES[k], label=f"ring block: the rank's rows against the keys "
                                              f"of rank {k}") for k in range(CP)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3,
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--picture", default=str(PNG))
    a = ap.parse_args()
    runs: dict[str, list] = {"allgather": [], "ring": []}
    for _ in range(a.rounds):
        for form in runs:
            runs[form].append(speed(form))
    with tempfile.TemporaryDirectory(prefix="ring-trace-") as d:
        measured = {}
        for name, on in (("balanced", True), ("in order", False)):
            path = str(Path(d, f"{name}.json"))
            measured[name] = traced(on, path)
            if on and a.picture:
                draw(json.loads(Path(path).read_text()), Path(a.picture))
    plan = {"balanced": planned(True), "in order": planned(False)}
    step = {f: median([r["step_s"] for r in rs]) for f, rs in runs.items()}
    losses = {f: rs[-1]["losses"] for f, rs in runs.items()}
    same = max(abs(x - y) for x, y in zip(losses["ring"], losses["allgather"]))
    spread = {k: max(v.values()) / min(v.values()) for k, v in measured.items()}
    plan_spread = {k: max(v) / min(v) for k, v in plan.items()}
    lines = [f"# Ring attention: GPT small at seq {SEQ}, cp={CP} on {CP} gloo processes", "",
             "| form | step (s) | losses |", "|---|---|---|"]
    for f in runs:
        lines.append(f"| {f} | {step[f]:.3f} | {', '.join(f'{x:.5f}' for x in losses[f])} |")
    lines += ["", f"ring / all-gather step: {step['ring'] / step['allgather']:.3f}x; losses "
              f"differ by at most {same:.1e}", "",
              "| ring, causal | measured seconds in ring blocks per rank | max / min | "
              "planned attention flops per rank (G) | max / min |", "|---|---|---|---|---|"]
    for k in measured:
        lines.append(f"| {k} | {', '.join(f'{x:.3f}' for x in measured[k].values())} | "
                     f"{spread[k]:.3f} | {', '.join(f'{x / 1e9:.2f}' for x in plan[k])} | "
                     f"{plan_spread[k]:.3f} |")
    ok = {True: "met", False: "NOT met"}
    lines += ["", f"balanced, measured within 10%: {ok[spread['balanced'] <= 1.10]}; "
              f"planned within 5%: {ok[plan_spread['balanced'] <= 1.05]}"]
    write("long_context_ring", {"machine": machine(), "seq": SEQ, "cp": CP, "rounds": a.rounds,
                                "step_s": step, "runs": runs, "losses_max_diff": same,
                                "measured_block_s": measured, "planned_attention_flops": plan,
                                "picture": a.picture},
          "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
