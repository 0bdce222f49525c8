"""Runtime step time: meshplan's pipeline vs torch.distributed.pipelining,
the ideal pipeline, and meshplan single-rank vs eager.

GPT (8 layers, hidden 128, 4 heads, seq 64, vocab 1024), global batch 16,
SGD (lr 0.05, momentum 0.9, wd 1e-4), one thread per process, CPU, gloo.
Every configuration runs once per round (2 warm-up steps, then timed ones),
rounds one after another, each run started once the CPUs are quiet: the
machine is shared, and measured: another process's burst doubles a 2-rank
step. A pipeline step's time is the max over ranks (meshplan's `run` times
each rank's step without a barrier; the torch pipeline between barriers).
Ratios of the median step (target):
- meshplan pp=2 vpp=2 / torch ScheduleInterleaved1F1B, same split (<= 0.8)
- meshplan pp=2 vpp=2 / ideal = eager / pp * (1 + (pp-1)/(vpp*m)) (<= 1.15)
- meshplan single rank / eager, one micro-batch of 16 (<= 1.05)
Both pipelines' losses are checked against each other and against eager
training with the same 8 micro-batches (`reference.eager_train`).
If a pp target is missed, meshplan pp runs with each rank executor's own
timing spans on (`harness.py`), as it is and with every receive of a step
posted at its start (a what-if run before each step), to say where the
time goes.

Run: python benchmarks/runtime.py [--steps K] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    BATCH,
    LOSS_TOLERANCE,
    SHAPE,
    WARMUP,
    TorchPipeline,
    alternate,
    batches,
    best_round,
    cfg,
    join_group,
    machine,
    max_diff,
    meshplan_rank,
    spawn_ranks,
    timed_median,
    timed_steps,
    wait_quiet,
    write,
    write_rank,
)
from harness import phase_seconds, profiled_step  # noqa: E402

from meshplan.autodiff import OptimizerConfig  # noqa: E402
from meshplan.driver.plan import plan_model, zoo_strategy  # noqa: E402
from meshplan.driver.reference import eager_train, split_microbatches  # noqa: E402
from meshplan.driver.run import run  # noqa: E402
from meshplan.ir.fileio import write_atomic  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.models import build_model  # noqa: E402

MICRO, PP, VPP = 2, 2, 2
M = BATCH // MICRO
STAGES = PP * VPP
TARGETS = {"pp_vs_torch": 0.8, "pp_vs_ideal": 1.15, "single_vs_eager": 1.05}


# ------------------------------------------------------------------ meshplan
def meshplan_pp(steps: int) -> dict:
    s = zoo_strategy("gpt", cfg(), pp=PP, vpp=VPP, global_batch_size=BATCH,
                     micro_batch_size=MICRO)
    return run("gpt", "tiny", Mesh(1, PP), s, steps=steps, threads=1, **SHAPE)


def meshplan_single(steps: int, micro: int = BATCH) -> dict:
    s = zoo_strategy("gpt", cfg(), global_batch_size=BATCH, micro_batch_size=micro)
    return run("gpt", "tiny", Mesh(1, 1), s, steps=steps, threads=1, **SHAPE)


# ------------------------------------------------------------------ eager
def eager(steps: int, microbatches: int) -> dict:
    """Eager training in this process, one thread; `microbatches` per step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = build_model(cfg())
    losses, times, _ = eager_train(module, batches(steps), microbatches,
                                OptimizerConfig.default("sgd"))
    return {"losses": losses, "step_s": times}


# ------------------------------------------------------------------ torch pipelining
def _torch_rank(rank: int, port: int, out: str, steps: int) -> None:
    device = join_group(rank, port, PP)
    pipe = TorchPipeline("ScheduleInterleaved1F1B", list(range(rank, STAGES, PP)), STAGES,
                         MICRO, M, device)
    losses, times = timed_steps(pipe.step, batches(steps), device)
    write_rank(out, rank, {"losses": losses, "step_s": times})
    dist.destroy_process_group()


def torch_pp(steps: int) -> dict:
    """ScheduleInterleaved1F1B on PP processes; step time is the max over ranks."""
    ranks = spawn_ranks(_torch_rank, (steps,), PP)
    losses = next(r["losses"] for r in ranks if r["losses"])
    return {"losses": losses,
            "step_s": [max(r["step_s"][i] for r in ranks) for i in range(steps)]}


# ------------------------------------------------------------------ profile
def _prepost_recvs(ex):
    """Diagnostic what-if, run before each step: post every receive of the
    step through the executor's own `post_recv` (which the executor's `recv`
    then finds posted), instead of one action ahead."""
    from meshplan.schedules.action import ActionType

    kinds = (ActionType.RECV_F, ActionType.RECV_B)
    actions = [a for a in ex.plan.actions if a.type in kinds]

    def post_all() -> None:
        for a in actions:
            ex.transfers.post_recv(a)

    return post_all


def _profile_rank(rank: int, port: int, out: str, job_path: str, steps: int,
                  prepost: bool) -> None:
    device = join_group(rank, port, PP)
    ex, state = meshplan_rank(job_path, rank, device)
    before_step = _prepost_recvs(ex) if prepost else (lambda: None)
    timed = []
    for i, batch in enumerate(batches(steps)):
        mbs = split_microbatches(batch, M)
        before_step()
        try:  # no barrier: as meshplan's worker times its steps
            step = profiled_step(ex, state, mbs)
        except RuntimeError as e:  # a timed-out wait: say where, keep the benchmark going
            fail = {"step": i, "action": ex.current, "error": str(e).splitlines()[0][:300]}
            write_rank(out, rank, {"failed": fail})
            return
        if i >= WARMUP:
            timed.append(step)
    write_rank(out, rank, {"step_s": sum(wall for wall, _ in timed) / len(timed),
                           "phases_s": phase_seconds(timed)})
    dist.destroy_process_group()


def profile_pp(steps: int, prepost: bool = False) -> dict:
    """Per rank, mean seconds per step in each executor phase of the pp run."""
    s = zoo_strategy("gpt", cfg(), pp=PP, vpp=VPP, global_batch_size=BATCH,
                     micro_batch_size=MICRO)
    job = plan_model("gpt", "tiny", Mesh(1, PP), s, "sgd", **SHAPE).job
    with tempfile.TemporaryDirectory(prefix="runtime-prof-") as d:
        job_path = Path(d, "job.bin")
        write_atomic(job_path, job.to_bytes())
        ranks = spawn_ranks(_profile_rank, (str(job_path), steps, prepost), PP)
    return {str(r): v for r, v in enumerate(ranks)}


# ------------------------------------------------------------------ report
CONFIGS = {"eager": ("eager, 1 process, 1x16", lambda n: eager(n, 1)),
           "eager_8x2": ("eager, 1 process, 8x2 (loss reference)", lambda n: eager(n, M)),
           "meshplan_single": ("meshplan, 1 rank, 1x16", meshplan_single),
           "meshplan_single_8x2": ("meshplan, 1 rank, 8x2",
                                   lambda n: meshplan_single(n, MICRO)),
           "meshplan_pp": ("meshplan, pp=2 vpp=2, 8x2", meshplan_pp),
           "torch_pp": ("torch ScheduleInterleaved1F1B, 2 ranks, 8x2", torch_pp)}
NAMES = {"pp_vs_torch": "meshplan pp / torch pipelining",
         "pp_vs_ideal": "meshplan pp / ideal (eager / pp x (1 + bubble))",
         "single_vs_eager": "meshplan single rank / eager"}


def measure(steps: int, rounds: int) -> dict:
    """Every configuration once per round (`alternate`). Losses are round 0's
    (every round trains the same batches from seed 0)."""
    runs = alternate({k: partial(fn, steps) for k, (_, fn) in CONFIGS.items()}, rounds)
    return {k: {"losses": v["rounds"][0]["losses"],
                "rounds": [r["step_s"] for r in v["rounds"]],
                "busy_before": v["busy_before"]} for k, v in runs.items()}


def ratios(t: dict) -> dict:
    bubble = (PP - 1) / (VPP * M)
    ideal = t["eager"] / PP * (1 + bubble)
    return {"ideal_step_s": ideal, "bubble": bubble,
            "pp_vs_torch": t["meshplan_pp"] / t["torch_pp"],
            "pp_vs_ideal": t["meshplan_pp"] / ideal,
            "single_vs_eager": t["meshplan_single"] / t["eager"]}


def losses_check(runs: dict) -> dict:
    """Both pipelines against each other and against eager with 8 micro-batches."""
    loss = {k: v["losses"] for k, v in runs.items()}
    pairs = {"meshplan_pp_vs_torch_pp": ("meshplan_pp", "torch_pp"),
             "meshplan_pp_vs_eager_8x2": ("meshplan_pp", "eager_8x2"),
             "torch_pp_vs_eager_8x2": ("torch_pp", "eager_8x2"),
             "meshplan_single_vs_eager": ("meshplan_single", "eager"),
             "meshplan_single_8x2_vs_eager_8x2": ("meshplan_single_8x2", "eager_8x2")}
    return {"per_step": loss, "tolerance": LOSS_TOLERANCE,
            "max_abs_diff": {k: max_diff(loss[a], loss[b]) for k, (a, b) in pairs.items()}}


def _eager_rank(rank: int, port: int, out: str, steps: int) -> None:
    write_rank(out, rank, timed_median([eager(steps, 1)["step_s"]]))


def concurrency(steps: int) -> dict:
    """Eager 1x16 alone, then in PP processes at once: what running PP
    single-threaded processes side by side costs each on this machine."""
    wait_quiet()
    alone = timed_median([eager(steps, 1)["step_s"]])
    wait_quiet()
    together = spawn_ranks(_eager_rank, (steps,), PP)
    return {"alone_s": alone, "together_s": together, "slowdown": max(together) / alone}


def _mean_phases(runs: list[dict]) -> dict:
    """Per rank, the mean over runs of each phase's seconds per step."""
    n = len(runs)
    return {r: {"step_s": sum(x[r]["step_s"] for x in runs) / n,
                "phases_s": {k: sum(x[r]["phases_s"][k] for x in runs) / n
                             for k in runs[0][r]["phases_s"]}}
            for r in runs[0]}


def profile(steps: int, rounds: int) -> dict:
    """The instrumented pp run as it is and with every receive posted at the
    step's start, alternating; per rank and phase, the mean over the rounds
    that finished; and the machine's cost of running PP processes at once."""
    out: dict = {"as_is": [], "recvs_posted_at_step_start": []}
    for _ in range(rounds):
        for name, prepost in (("as_is", False), ("recvs_posted_at_step_start", True)):
            wait_quiet()
            out[name].append(profile_pp(steps, prepost))
    failed = {name: [run for run in runs if any("failed" in v for v in run.values())]
              for name, runs in out.items()}
    mean = {name: _mean_phases([run for run in runs if run not in failed[name]])
            for name, runs in out.items() if len(failed[name]) < len(runs)}
    return {"per_round": out, "failed": failed, "mean": mean,
            "concurrency": concurrency(steps)}


def _phase_line(name: str, prof: dict) -> str:
    parts = []
    for r, p in prof.items():
        ph = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in p["phases_s"].items())
        parts.append(f"rank {r} {p['step_s'] * 1e3:.0f} ms = {ph}")
    return f"- {name}, per step (ms): " + "; ".join(parts) + "."


def _worst(prof: dict, *keys: str) -> float:
    return max(sum(p["phases_s"].get(k, 0.0) for k in keys) for p in prof.values())


def profile_lines(prof: dict, what_if: dict, conc: dict, t: dict) -> list[str]:
    """Where a meshplan pp step's time goes, from the instrumented runs."""
    comp = _worst(prof, "forward", "backward", "optimizer")
    floor = t["eager_8x2"] / PP * conc["slowdown"] * (1 + (PP - 1) / (VPP * M))
    wait, step = _worst(prof, "recv (wait)"), max(p["step_s"] for p in prof.values())
    bubble = (PP - 1) / (VPP * M)
    return [
        _phase_line("meshplan pp with timers around each executor phase", prof),
        f"- Compute (forward+backward+optimizer) is {comp * 1e3:.0f} ms on the busier rank "
        f"vs eager/pp = {t['eager'] / PP * 1e3:.0f} ms: micro-batches of 2 cost more than "
        f"one of 16 (eager 8x2: {t['eager_8x2'] * 1e3:.0f} ms vs 1x16: "
        f"{t['eager'] * 1e3:.0f} ms per step, x{t['eager_8x2'] / t['eager']:.2f}; "
        f"meshplan 1 rank 8x2: {t['meshplan_single_8x2'] * 1e3:.0f} ms, "
        f"x{t['meshplan_single_8x2'] / t['eager_8x2']:.2f} eager 8x2).",
        f"- Waiting in recv: up to {wait * 1e3:.0f} ms ({wait / step:.0%} of the step) vs "
        f"a bubble of {bubble:.3f} x compute = {bubble * comp * 1e3:.0f} ms (the executor "
        "posts each receive one action ahead).",
        _phase_line("What-if, every receive of a step posted at its start instead (this "
                    "benchmark patches one executor instance; meshplan unchanged)", what_if),
        f"- {PP} single-thread processes at once run slower each here: eager 1x16 "
        f"{conc['alone_s'] * 1e3:.0f} ms alone vs {max(conc['together_s']) * 1e3:.0f} ms "
        f"side by side (x{conc['slowdown']:.2f}); with x{t['eager_8x2'] / t['eager']:.2f} for "
        f"micro-batches of 2, this machine's floor for the pp step is about eager 8x2 / pp x "
        f"{conc['slowdown']:.2f} x (1 + bubble) = {floor * 1e3:.0f} ms "
        f"({floor / ratios(t)['ideal_step_s']:.2f} x the ideal).",
    ]


def table(a, t: dict, best: dict, loss: dict, load: list, prof_lines: list[str]) -> str:
    r, rb = ratios(t), ratios(best)
    lines = [f"Runtime step time: GPT 8x128 (seq 64, vocab 1024), global batch 16, SGD, "
             f"1 thread per process; median of {a.rounds} rounds x {a.steps - WARMUP} steps "
             f"(each after {WARMUP} warm-up), configurations alternating by round, each "
             "started once the CPUs were quiet (or after 10 s); pipeline "
             f"steps are the max over ranks. Load average before/after: {load[0]:.1f}/"
             f"{load[1]:.1f} on {machine()['cpu_count']} CPUs.", "",
             "| configuration | median step (ms) | best round's median (ms) |",
             "|---|---|---|"]
    lines += [f"| {label} | {t[k] * 1e3:.1f} | {best[k] * 1e3:.1f} |"
              for k, (label, _) in CONFIGS.items()]
    lines += [f"| ideal pp=2 vpp=2 (eager / 2 x {1 + r['bubble']:.4f}) | "
              f"{r['ideal_step_s'] * 1e3:.1f} | {rb['ideal_step_s'] * 1e3:.1f} |", ""]
    for k, name in NAMES.items():
        met = "met" if r[k] <= TARGETS[k] else "NOT met"
        lines.append(f"- {name} = {r[k]:.3f} (target <= {TARGETS[k]}): {met} "
                     f"(best rounds: {rb[k]:.3f})")
    d = loss["max_abs_diff"]
    agree = "agree" if max(d.values()) <= loss["tolerance"] else "DISAGREE"
    lines.append("- losses, max |diff| per step: " + ", ".join(
        f"{k.replace('_vs_', ' vs ')} {v:.1e}" for k, v in d.items()) + f" ({agree})")
    if prof_lines:
        lines += ["", "Where the meshplan pp step's time goes (mean of the profile rounds):",
                  ""] + prof_lines
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per configuration per "
                    f"round, the first {WARMUP} untimed")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    load = [os.getloadavg()[0]]
    runs = measure(a.steps, a.rounds)
    t = {k: timed_median(v["rounds"]) for k, v in runs.items()}
    best = {k: best_round(v["rounds"]) for k, v in runs.items()}
    r = ratios(t)
    loss = losses_check(runs)
    for k in ("meshplan_pp", "torch_pp", "eager_8x2"):
        print(f"losses {k:12s}", " ".join(f"{x:.6f}" for x in loss["per_step"][k]))
    met = {k: r[k] <= v for k, v in TARGETS.items()}
    result = {"benchmark": "runtime", "machine": machine(), "model": SHAPE,
              "global_batch": BATCH, "micro_batch": MICRO, "pp": PP, "vpp": VPP,
              "optimizer": "sgd", "warmup_steps": WARMUP, "steps": a.steps,
              "rounds": a.rounds, "targets": TARGETS, "median_step_s": t, "ratios": r,
              "best_round_step_s": best, "best_round_ratios": ratios(best),
              "met": met, "step_s": {k: v["rounds"] for k, v in runs.items()},
              "cpu_busy_before": {k: v["busy_before"] for k, v in runs.items()},
              "losses": loss}
    prof_lines = []
    if not (met["pp_vs_torch"] and met["pp_vs_ideal"]):
        result["profile_pp"] = prof = profile(a.steps * 2, 3)
        if len(prof["mean"]) == 2:
            prof_lines = profile_lines(prof["mean"]["as_is"],
                                       prof["mean"]["recvs_posted_at_step_start"],
                                       prof["concurrency"], t)
        prof_lines += [f"- {name}: {len(runs)} profile run(s) timed out in a receive: "
                       f"{runs[0]}" for name, runs in prof["failed"].items() if runs]
    load.append(os.getloadavg()[0])
    result["load_average_before_after"] = load
    write("runtime", result, table(a, t, best, loss, load, prof_lines))


if __name__ == "__main__":
    main()
