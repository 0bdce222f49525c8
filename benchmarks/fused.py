"""Fused kernels (`--kernels inductor`, issue 39): meshplan's compute runs
compiled by Inductor against `torch.compile(model)` and eager PyTorch.

Five parts, one run (`python benchmarks/fused.py [--parts step,compile,pp2,cold,optimizer]`):

1. step: GPT small and BERT small, one process, AdamW, batch 8: eager
   PyTorch, `torch.compile(model)` (forward and backward compiled; torch's
   AdamW eager), meshplan with eager kernels and meshplan with Inductor, on
   the same weights and batch, one step of each in turn (the machine is
   noisy), after warm-up steps that compile; the median step of each.
   Targets: meshplan inductor <= 1.0x torch.compile's step, <= 0.85x eager's.
2. compile: the demo's layout (GPT tiny, dp2 tp2 pp2 vpp2, 8 local
   processes), `meshplan run --steps 2`, fresh processes: eager kernels,
   then Inductor with an empty cache (cold) and again with it (warm), each
   run's wall time and the ranks' Inductor seconds (`kernel_compile_s`:
   the runs' first calls). Target: warm at most 1.10x eager's wall time.
3. pp2: meshplan 1F1B on 2 processes, eager kernels and Inductor, against
   torch.distributed.pipelining's Schedule1F1B with eager and compiled
   stages (`fused_pp2.py`). Target: meshplan inductor <= 1.0x torch's
   compiled stages.
4. cold: GPT tiny at one process (AdamW) and at pp2 with 4 micro-batches
   (the demo's layout: part 2), `meshplan run --steps 2` in fresh processes with an
   empty cache folder, beside eager kernels: the wall time, each rank's
   build seconds, the packages built (the cost a machine pays once).
5. optimizer: GPT small's AdamW update as torch's per-tensor loop, torch's
   fused kernel (what `--kernels inductor` runs) and Inductor's code for
   it (`fused_optimizer.py`).

Run: python benchmarks/fused.py     (about 10 minutes on 2 cores, cold caches)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from fused_optimizer import optimizer_part, optimizer_table  # noqa: E402
from fused_pp2 import CONFIGS as PP2_CONFIGS  # noqa: E402
from fused_pp2 import pp2_part  # noqa: E402

from meshplan.autodiff.optimizer import OptimizerConfig, torch_optimizer  # noqa: E402
from meshplan.capture import capture  # noqa: E402
from meshplan.driver.executor import Executor  # noqa: E402
from meshplan.ir.mesh import Mesh, Strategy  # noqa: E402
from meshplan.models import build_model, example_batch, model_config  # noqa: E402
from meshplan.passes.plan import PASSES, Compilation  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"vs_torch_compile": 1.0, "vs_eager": 0.85, "warm_over_eager": 1.10}


def step_part(model: str, batch: int = 8, steps: int = 8, warmup: int = 3) -> dict:
    cfg = model_config(model, "small")
    torch.manual_seed(0)
    module = build_model(cfg)
    opt_cfg = OptimizerConfig.default("adamw")
    data = example_batch(cfg, batch)
    graph = PASSES.run(Compilation(capture(module, data), Mesh(1, 1), Strategy(), opt_cfg),
                       stop_after="autodiff").graph
    contenders = {}
    eager_ref = copy.deepcopy(module)
    contenders["eager"] = common.torch_step(eager_ref, torch_optimizer(opt_cfg, eager_ref),
                                            data)
    compiled_ref = copy.deepcopy(module)
    contenders["torch.compile"] = common.torch_step(torch.compile(compiled_ref),
                                                    torch_optimizer(opt_cfg, compiled_ref), data)
    for kernels in ("eager", "inductor"):
        ex = Executor(graph, "cpu", kernels)
        state = ex.init_state(module)
        contenders[f"meshplan {kernels}"] = (lambda ex=ex, state=state:
                                             ex.step(state, [data]))
    times: dict[str, list[float]] = {k: [] for k in contenders}
    losses: dict[str, list[float]] = {k: [] for k in contenders}
    first: dict[str, float] = {}
    for i in range(warmup + steps):
        for name, step in contenders.items():
            t0 = time.perf_counter()
            losses[name].append(float(step()))
            dt = time.perf_counter() - t0
            if i == 0 or i == 1 and name == "meshplan inductor":  # to its first compiled
                first[name] = first.get(name, 0.0) + dt  # step: its first runs eager kernels
            if i >= warmup:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": f"{model}-small", "batch": batch, "steps": steps, "warmup": warmup,
            "step_s": med, "first_step_s": first, "losses": losses,
            "vs_torch_compile": med["meshplan inductor"] / med["torch.compile"],
            "vs_eager": med["meshplan inductor"] / med["eager"],
            "loss_diff_vs_eager": max(abs(a - b) for a, b in zip(losses["meshplan inductor"],
                                                                  losses["eager"]))}


DEMO = ["--nodes", "2", "--devices-per-node", "4", "--dp", "2", "--tp", "2", "--pp", "2",
        "--vpp", "2", "--schedule", "interleaved", "--micro-batch-size", "1",
        "--global-batch-size", "16"]
COLD = {  # layouts whose cold start part 4 measures: (what, `meshplan run` arguments)
    "gpt tiny, 1 process, AdamW": ["--optimizer", "adamw", "--global-batch-size", "8"],
    "gpt tiny, pp2, 4 micro-batches": ["--devices-per-node", "2", "--pp", "2",
                                       "--micro-batch-size", "2", "--global-batch-size", "8"],
}  # the demo's layout: part 2


def _run(kernels: str, cache: str, layout: list[str] = DEMO, steps: int = 2) -> dict:
    """`meshplan run` of GPT tiny at `layout` in fresh processes, with Inductor's
    cache folder `cache`: its wall time, the ranks' first-call seconds of their
    runs, and the packages the cache then holds."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "meshplan", "run", "--model", "gpt", "--size",
                        "tiny", *layout, "--steps", str(steps), "--kernels", kernels,
                        "--timeout", "600", "--json"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    res = json.loads(p.stdout)
    compile_s = [r.get("kernel_compile_s", 0.0) for r in res["ranks"].values()]
    return {"kernels": kernels, "wall_s": wall, "first_step_s": res.get("step_s", [None])[0],
            "kernel_compile_s": compile_s, "losses": res.get("losses"),
            "packages": len(list(Path(cache).glob("meshplan-aot/*.pt2"))),
            "notes": [n for r in res["ranks"].values() for n in r.get("kernel_notes", [])]}


def compile_part() -> dict:
    with tempfile.TemporaryDirectory() as cache:
        common.wait_quiet(30)
        eager = _run("eager", cache)
        common.wait_quiet(30)
        cold = _run("inductor", cache)
        common.wait_quiet(30)
        warm = _run("inductor", cache)
        common.wait_quiet(30)
        eager2 = _run("eager", cache)
    base = statistics.median([eager["wall_s"], eager2["wall_s"]])
    return {"eager": [eager, eager2], "cold": cold, "warm": warm,
            "warm_over_eager": warm["wall_s"] / base, "cold_over_eager": cold["wall_s"] / base}


def cold_part() -> dict:
    """Each `COLD` layout's first steps with an empty cache: what a first
    `meshplan run --kernels inductor` on a machine costs, and the packages
    it builds, beside eager kernels' run of the same layout."""
    out = {}
    for name, layout in COLD.items():
        with tempfile.TemporaryDirectory() as cache:
            common.wait_quiet(30)
            eager = _run("eager", cache, layout)
            common.wait_quiet(30)
            out[name] = {"eager": eager, "cold": _run("inductor", cache, layout)}
    return out


def table(res: dict) -> str:
    lines = ["# Fused kernels (`--kernels inductor`)", "",
             f"Machine: {res['machine']['cpu_count']} CPUs, torch {res['machine']['torch']}.",
             ""]
    if "step" in res:
        lines += ["## 1. Step time, one process, AdamW, batch 8 (median of interleaved steps)",
                  "", "| model | eager (ms) | torch.compile (ms) | meshplan eager (ms) | "
                  "meshplan inductor (ms) | inductor / torch.compile | inductor / eager | "
                  "to the first compiled step: torch.compile, meshplan inductor (s) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in res["step"]:
            s, f = r["step_s"], r["first_step_s"]
            lines.append(
                f"| {r['model']} | {s['eager'] * 1e3:.0f} | {s['torch.compile'] * 1e3:.0f} | "
                f"{s['meshplan eager'] * 1e3:.0f} | {s['meshplan inductor'] * 1e3:.0f} | "
                f"{r['vs_torch_compile']:.3f} | {r['vs_eager']:.3f} | "
                f"{f['torch.compile']:.1f}, {f['meshplan inductor']:.1f} |")
        worst_tc = max(r["vs_torch_compile"] for r in res["step"])
        worst_e = max(r["vs_eager"] for r in res["step"])
        lines += ["", f"- meshplan inductor / torch.compile: at most {worst_tc:.3f} (target <= "
                  f"{TARGETS['vs_torch_compile']}): "
                  f"{'met' if worst_tc <= TARGETS['vs_torch_compile'] else 'NOT met'}",
                  f"- meshplan inductor / eager: at most {worst_e:.3f} (target <= "
                  f"{TARGETS['vs_eager']}): "
                  f"{'met' if worst_e <= TARGETS['vs_eager'] else 'NOT met'}", ""]
    if "compile" in res:
        c = res["compile"]

        def row(name, r):
            ks = r["kernel_compile_s"]
            return (f"| {name} | {r['wall_s']:.1f} | {max(ks):.1f} | "
                    f"{statistics.median(ks):.1f} | {len(r['notes'])} |")
        lines += ["## 2. Compile cost: the demo's layout (GPT tiny, dp2 tp2 pp2 vpp2, 8 "
                  "processes), `meshplan run --steps 2`", "",
                  "| kernels | wall (s) | Inductor s per rank, max | median | refused runs |",
                  "|---|---|---|---|---|", row("eager", c["eager"][0]),
                  row("inductor, cold cache", c["cold"]),
                  row("inductor, warm cache", c["warm"]), row("eager, again", c["eager"][1]),
                  "", f"- warm / eager wall: {c['warm_over_eager']:.2f} (target <= "
                  f"{TARGETS['warm_over_eager']}): "
                  f"{'met' if c['warm_over_eager'] <= TARGETS['warm_over_eager'] else 'NOT met'}"
                  f"; cold / eager: {c['cold_over_eager']:.2f}", ""]
    if "pp2" in res:
        c = res["pp2"]["configs"]
        lines += ["## 3. pp=2 on 2 processes, 1F1B (GPT 8 layers, hidden 128, seq 64, batch 16 "
                  "as 4 micro-batches, SGD)", "",
                  "| system | step (ms) | per round (ms) | to the first compiled step (s) | "
                  "max loss diff vs torch eager |", "|---|---|---|---|---|"]
        for k in PP2_CONFIGS:
            r = c[k]
            lines.append(f"| {k} | {r['step_s'] * 1e3:.1f} | "
                         f"{', '.join(f'{x * 1e3:.1f}' for x in r['per_round_s'])} | "
                         f"{max(r['first_step_s']):.1f} | {r['loss_diff_vs_torch_eager']:.1e} |")
        ratio = c["vs_torch_compiled"]
        lines += ["", f"- meshplan inductor / torch pipelining with compiled stages: {ratio:.3f} "
                  f"(target <= {TARGETS['vs_torch_compile']}): "
                  f"{'met' if ratio <= TARGETS['vs_torch_compile'] else 'NOT met'}", ""]
    if "cold" in res:
        lines += ["## 4. A cold cache: `meshplan run --steps 2 --kernels inductor`, fresh "
                  "processes, an empty cache folder", "",
                  "| layout | eager wall (s) | cold wall (s) | build s per rank, max | packages "
                  "built | refused runs | same losses as eager |", "|---|---|---|---|---|---|---|"]
        for name, r in res["cold"].items():
            e, c = r["eager"], r["cold"]
            diff = max(abs(a - b) for a, b in zip(e["losses"], c["losses"]))
            lines.append(f"| {name} | {e['wall_s']:.1f} | {c['wall_s']:.1f} | "
                         f"{max(c['kernel_compile_s']):.1f} | {c['packages']} | "
                         f"{len(c['notes'])} | within {diff:.1e} |")
        lines.append("")
    if "optimizer" in res:
        lines += optimizer_table(res["optimizer"])
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="step,compile,pp2,cold,optimizer")
    args = p.parse_args()
    path = common.RESULTS / "fused.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    res["machine"], res["targets"] = common.machine(), TARGETS
    for name in args.parts.split(","):
        print(f"== {name}", flush=True)
        res[name] = ([step_part("gpt"), step_part("bert")] if name == "step" else
                     compile_part() if name == "compile" else
                     cold_part() if name == "cold" else
                     optimizer_part() if name == "optimizer" else pp2_part())
        common.write("fused", res, table(res))
    print(table(res))


if __name__ == "__main__":
    main()
