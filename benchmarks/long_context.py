"""Long context (issue 37): context parallelism's memory, its load balance,
and torch's own `context_parallel` as the anchor.

Setup: GPT small (8 layers, hidden 256, 8 heads, vocab 1024) at seq 2048,
one sample a step, SGD, fp32, CPU, gloo over 127.0.0.1, one thread a rank.

Four parts, one run:
1. planned: the activation peak per rank of the memory plan
   (`lower(job, 0).memory.peak`) at cp 1, 2 and 4, and tp2 with and without
   sequence parallelism.
2. measured: `meshplan run --json` as a user runs it, cp1 (1 process) and
   cp2 (2 processes), 3 steps, 2 rounds alternating once the CPUs are
   quiet: each rank's measured peak (the executor's count of live tensors)
   against its plan's, and the step time (median of the steps after the
   first).
3. load balance: cp4 with the ring (`--cp-attention ring`, `auto`'s form
   for a balanced causal sequence), causal, each rank's attention flops
   from its plan (the pairs of positions its blocks see), balanced and in
   order.
4. anchor: `torch.distributed.tensor.experimental.context_parallel` on 2
   gloo processes, the same GPT's loss and backward under it; its result,
   or its error when it does not run here.

Targets: cp2's activations per rank <= 0.55x of cp1's (planned), the
measured peaks within 10% of the plan, cp4's attention flops per rank
within 5% of each other.

Run: python benchmarks/long_context.py [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, wait_quiet, write  # noqa: E402

from meshplan.costmodel import load_device_model  # noqa: E402
from meshplan.driver.plan import plan_model, zoo_strategy  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.lowering.action_times import attention_flops  # noqa: E402
from meshplan.lowering.lower import lower  # noqa: E402
from meshplan.models import build_model, example_batch, model_config  # noqa: E402

SEQ = 2048
MiB = 1 << 20


def _job(**fields):
    cfg = model_config("gpt", "small", seq_len=SEQ)
    world = fields.get("cp", 1) * fields.get("tp", 1)
    s = zoo_strategy("gpt", cfg, global_batch_size=1, micro_batch_size=1, **fields)
    return plan_model("gpt", "small", Mesh(1, world), s, "sgd", None, seq_len=SEQ).job


def planned() -> dict:
    rows = {}
    for name, fields in (("cp1", {}), ("cp2", {"cp": 2}), ("cp4", {"cp": 4}),
                         ("tp2", {"tp": 2}), ("tp2 sp", {"tp": 2, "sequence_parallel": True})):
        rows[name] = dict(lower(_job(**fields), 0).memory.peak)["activation"]
    return rows


def _run(cp: int) -> dict:
    wait_quiet()
    cmd = [sys.executable, "-m", "meshplan", "run", "--model", "gpt", "--size", "small",
           "--seq-len", str(SEQ), "--devices-per-node", str(cp), "--cp", str(cp),
           "--global-batch-size", "1", "--micro-batch-size", "1", "--optimizer", "sgd",
           "--steps", "3", "--json"]
    got = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    ranks = got["ranks"]
    return {"step_s": median(got["step_s"][1:]), "losses": got["losses"],
            "planned": [ranks[r]["planned_peak_bytes"] for r in sorted(ranks)],
            "measured": [ranks[r]["measured_peak_bytes"] for r in sorted(ranks)]}


def balance() -> dict:
    dev = load_device_model("h100-80gb")
    out = {}
    for name, on in (("balanced", True), ("in order", False)):
        job = _job(cp=4, cp_balance=on, cp_attention="ring")
        out[name] = [attention_flops(job, lower(job, r), dev) for r in range(4)]
    return out


def _anchor_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = model_config("gpt", "small", seq_len=SEQ)
    torch.manual_seed(0)
    model = build_model(cfg)
    tokens, targets = example_batch(cfg, 1, seed=0)
    try:
        with context_parallel(init_device_mesh("cpu", (2,)), buffers=[tokens, targets],
                              buffer_seq_dims=[1, 1]):
            loss = model(tokens, targets)
            loss.backward()
        got = {"ran": True, "loss": float(loss)}
    except Exception as err:  # the anchor's own failure is the result
        got = {"ran": False, "error": f"{type(err).__name__}: {err}"}
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.destroy_process_group()


def anchor() -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "anchor.json")
        mp.spawn(_anchor_rank, args=(29600 + os.getpid() % 300, out), nprocs=2)
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    plan = planned()
    runs: dict[int, list] = {1: [], 2: []}
    for _ in range(a.rounds):
        for cp in runs:
            runs[cp].append(_run(cp))
    lb = balance()
    torch_cp = anchor()
    measured = {cp: {"step_s": median([r["step_s"] for r in rs]), "planned": rs[-1]["planned"],
                     "measured": rs[-1]["measured"], "losses": rs[-1]["losses"]}
                for cp, rs in runs.items()}
    ratio = plan["cp2"] / plan["cp1"]
    follow = max(abs(m / p - 1) for r in measured.values()
                 for m, p in zip(r["measured"], r["planned"]))
    spread = {k: max(v) / min(v) for k, v in lb.items()}
    lines = [
        "# Long context: GPT small at seq 2048", "",
        "| planned activation peak per rank | MiB | x of cp1 (tp2 for sp) |", "|---|---|---|"]
    for name, b in plan.items():
        base = plan["tp2"] if name.startswith("tp2") else plan["cp1"]
        lines.append(f"| {name} | {b / MiB:.1f} | {b / base:.3f} |")
    lines += ["", f"cp2's activations {ratio:.3f}x of cp1's (target <= 0.55): "
              f"{'met' if ratio <= 0.55 else 'NOT met'}", "",
              "| run | step (s) | planned peak per rank (MiB) | measured (MiB) | losses |",
              "|---|---|---|---|---|"]
    for cp, r in measured.items():
        lines.append(f"| cp{cp} | {r['step_s']:.3f} | "
                     f"{', '.join(f'{x / MiB:.1f}' for x in r['planned'])} | "
                     f"{', '.join(f'{x / MiB:.1f}' for x in r['measured'])} | "
                     f"{', '.join(f'{x:.4f}' for x in r['losses'])} |")
    lines += ["", f"measured peaks within {follow:.1%} of the plan (target 10%): "
              f"{'met' if follow <= 0.10 else 'NOT met'}", "",
              "| cp4 ring, causal attention flops per rank (M) | ranks 0-3 | "
              "max / min |",
              "|---|---|---|"]
    for k, v in lb.items():
        lines.append(f"| {k} | {', '.join(f'{x / 1e6:.1f}' for x in v)} | {spread[k]:.3f} |")
    lines += ["", f"balanced within 5%: {'met' if spread['balanced'] <= 1.05 else 'NOT met'}",
              "", "torch's context_parallel on CPU/gloo: " +
              (f"ran, loss {torch_cp['loss']:.4f}" if torch_cp["ran"] else
               f"does not run here: {torch_cp['error']}")]
    write("long_context", {"machine": machine(), "planned_activation_bytes": plan,
                           "measured": {f"cp{k}": v for k, v in measured.items()},
                           "attention_flops": lb, "torch_context_parallel": torch_cp},
          "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
