"""The `demo` verb: the main job on its embedded default, start to finish.

GPT tiny on 2 nodes x 4 devices (dp=2 tp=2 pp=2 vpp=2, 8 micro-batches):
capture and plan once, lower every rank in worker processes, prove the
plans consistent, train on 8 local gloo processes beside the eager
single-process reference, and write three files to `--out`: the simulated
schedule (`schedule.png`), the measured last step (`trace.json`) and both
loss curves (`losses.png`).

Invariant: it needs no GPU, no cluster and no download; every number it
prints comes from this run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from meshplan.cli.flags import add_device_flags
from meshplan.cli.pictures import draw_losses
from meshplan.cli.progress import Progress
from meshplan.cli.run_cmd import loss_table, trace_line
from meshplan.cli.show_cmd import schedule_png
from meshplan.cli.verdict import add_tolerance_flag, bounds_of, verdict_lines
from meshplan.driver.compile import compile_job
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.run import run_devices
from meshplan.driver.verify import verify
from meshplan.errors import ConfigError, PlanError
from meshplan.ir.fileio import write_atomic
from meshplan.ir.mesh import Mesh
from meshplan.lowering.check import check_plans
from meshplan.lowering.files import read_dir
from meshplan.models import model_config

MODEL, SIZE = "gpt", "tiny"
MESH = Mesh(nodes=2, devices_per_node=4)
STRATEGY = dict(dp=2, tp=2, pp=2, vpp=2, micro_batch_size=1, global_batch_size=16,
                schedule="interleaved")

EPILOG = """examples:
  meshplan demo
  meshplan demo --steps 3 --out /tmp/demo --json
  meshplan -q demo --out demo/        (no progress, just the results)"""


DESCRIPTION = """GPT tiny on 2 nodes x 4 devices (dp=2 tp=2 pp=2 vpp=2, 8 micro-batches), on
this machine: plan once, compile the 8 rank plans in worker processes, check
them, train on 8 local gloo processes beside eager PyTorch on one, and write
schedule.png (the simulated step), trace.json (the last step as measured on
every rank) and losses.png. No GPU, no cluster, no download."""


def add_demo_flags(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.add_argument("--out", default="meshplan-demo",
                   help="folder for plans/, schedule.png, trace.json, losses.png "
                   "(default meshplan-demo)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--workers", type=int, default=None,
                   help="compile worker processes (default: the number of cores)")
    add_tolerance_flag(p)

    add_device_flags(p)


def cmd_demo(a: argparse.Namespace) -> int:
    if a.steps < 1:
        raise ConfigError(f"--steps {a.steps}: the demo needs at least one step")
    r = demo(Path(a.out), a.steps, a.workers, a.progress, bounds_of(a), a.device, a.backend,
             a.kernels)
    ok = r["ok"]
    r["files"]["summary"] = str(Path(a.out) / "demo.json")
    write_atomic(Path(r["files"]["summary"]), json.dumps(r, indent=1).encode())
    if a.json:
        print(json.dumps(r))
        return 0 if ok else 1
    s = r["strategy"]
    print(f"GPT tiny on {MESH.nodes} nodes x {MESH.devices_per_node} devices: dp={s['dp']} "
          f"tp={s['tp']} pp={s['pp']} vpp={s['vpp']}, {r['num_microbatches']} micro-batches, "
          f"{r['ops']} ops in the Job")
    print(f"check: {len(r['plans'])} rank plans consistent; simulated bubble ratio "
          f"{r['simulated']['bubble_ratio']:.3f}\n")
    print(loss_table(r["ref_losses"], r["losses"]))
    print(f"the loss fell {r['loss_drop']:.0%} below its first step")
    print(verdict_lines(r))
    print(f"meshplan step {r['step_s'] * 1e3:.0f} ms on {MESH.world} processes, eager "
          f"{r['ref_step_s'] * 1e3:.0f} ms on one")
    print(trace_line(r["trace"]))
    for name, path in r["files"].items():
        print(f"  {name:<9} {path}")
    print(f"done in {r['timings']['total_s']:.1f} s")
    return 0 if ok else 1


def demo(out: Path, steps: int = 10, workers: int | None = None, progress=None,
         bounds=None, device: str = "cpu", backend: str = "", kernels: str = "eager") -> dict:
    """Compile, check, train and draw the demo job into `out` (on `device`,
    cpu | cuda | auto, with `backend` and `kernels`); returns the figures."""
    device, backend = run_devices(device, backend, MESH.world)

    progress = progress or Progress(quiet=True)
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    strategy = zoo_strategy(MODEL, model_config(MODEL, SIZE), **STRATEGY)
    progress.line("capturing GPT tiny and planning it for 2 nodes x 4 devices ...")
    job = plan_model(MODEL, SIZE, MESH, strategy).job
    t1 = time.perf_counter()
    with progress.task("lowering ranks", MESH.world) as update:
        compile_job(job, out / "plans", workers=workers, progress=lambda k, _: update(k),
                    device=device)
    t2 = time.perf_counter()
    job, plans = read_dir(out / "plans")
    res = check_plans(job, plans)
    if not res.ok:
        raise PlanError("the demo's plans failed the check:\n" + "\n".join(res.errors))
    png = schedule_png(job, plans, out / "schedule.png")
    t3 = time.perf_counter()
    with progress.task(f"training on {MESH.world} processes", steps) as update:
        r = verify(MODEL, SIZE, steps=steps, mesh=MESH, strategy=strategy, bounds=bounds,
                   device=device,
                   run_options={"plan_dir": str(out / "plans"), "backend": backend,
                                "kernels": kernels,
                                "trace": str(out / "trace.json"), "on_step": update})
    t4 = time.perf_counter()
    draw_losses(range(steps), r["losses"], r["ref_losses"], out / "losses.png",
                f"GPT tiny, dp=2 tp=2 pp=2 vpp=2 on {MESH.world} processes vs eager")
    files = {"plans": out / "plans", "schedule": out / "schedule.png",
             "trace": out / "trace.json", "losses": out / "losses.png"}
    return {
        "strategy": STRATEGY, "mesh": [MESH.nodes, MESH.devices_per_node],
        "num_microbatches": strategy.num_microbatches, "ops": len(job.graph.ops),
        "plans": sorted(plans), "steps": steps,
        **{k: r[k] for k in ("ok", "problems", "bounds", "losses", "rank_losses",
                             "ref_losses", "max_abs_diff", "params", "optimizer_state",
                             "step_s", "ref_step_s")},
        "loss_drop": 1 - r["losses"][-1] / r["losses"][0],
        "simulated": {"bubble_ratio": png["bubble_ratio"],
                      "predicted_step_s": res.predicted_step_s},
        "trace": r["trace"], "files": {k: str(v) for k, v in files.items()},
        "timings": {"plan_s": t1 - t0, "compile_s": t2 - t1, "check_s": t3 - t2,
                    "train_s": t4 - t3, "total_s": time.perf_counter() - t0},
    }
