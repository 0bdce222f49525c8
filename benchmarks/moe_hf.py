"""transformers' Mixtral, its expert blocks as one routed op, against the
same blocks as their captured ops (how meshplan ran them before).

Setup: `--hf mixtral --size small` (8 layers, hidden 256, 8 heads, seq 128,
vocab 1024; transformers' own config otherwise: 4 experts, top-2) on 2 gloo
processes over 127.0.0.1, one thread each, CPU, SGD; global batch 4 = 1
micro-batch x 2 samples x 2 ranks. Every configuration trains from seed 0
on the same batches (step k's from seed k).
- ep2: `Strategy(dp=2, ep=2)`, blocks fused (`capture/routed_experts.py`):
  each rank holds 2 of the 4 experts; its rows reach them, and come back,
  by all-to-alls inside the routed kernel (`runtime/expert_dispatch.py`).
- dp2: `Strategy(dp=2)`, blocks fused: each rank its own tokens, every
  expert.
- ep2-ops, dp2-ops: the same strategies with the blocks left as their ops
  (the fusion turned off while capturing): a sort has no token shard, so
  each rank runs every block on the whole micro-batch's tokens (gathered),
  and at ep2 gathers the expert weights too.

Measured:
- step time: the max over ranks of a step timed between barriers
  (`common.timed_steps`), the median over the rounds' steps after the
  warm-up; the configurations alternate round by round (`common.alternate`).
- the routed all-to-alls (ep2): every `Comm.all_to_all` call a rank makes
  during 3 steps after the timed ones, summed per step (the counts, the
  rows there and back; the backward's five), median over steps and ranks.
- memory per rank: the expert weights' bytes, the plan's peak beside the
  executor's own count of the values it holds (the largest over ranks; a
  kernel's own buffers, the routed rows among them, are not values).

Run: python benchmarks/moe_hf.py [--steps K] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    WARMUP,
    alternate,
    best_round,
    join_group,
    machine,
    max_diff,
    median,
    meshplan_rank,
    spawn_ranks,
    timed_median,
    timed_steps,
    write,
    write_rank,
)

from meshplan.capture import export  # noqa: E402
from meshplan.driver.job_report import report  # noqa: E402
from meshplan.driver.plan import plan_model, zoo_strategy  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.lowering.files import write_atomic  # noqa: E402
from meshplan.models import example_batch, model_config  # noqa: E402
from meshplan.passes.expert_parallel import is_expert_param  # noqa: E402
from meshplan.runtime.comm import Comm  # noqa: E402
from meshplan.runtime.data import split_microbatches  # noqa: E402

MODEL, SIZE = "hf:mixtral", "small"
WORLD, BATCH, MICRO = 2, 4, 2
CPU = torch.device("cpu")
CONFIGS = {"ep2": (dict(dp=2, ep=2), True), "dp2": (dict(dp=2), True),
           "ep2-ops": (dict(dp=2, ep=2), False), "dp2-ops": (dict(dp=2), False)}
PROFILE_STEPS = 3


def cfg():
    return model_config(MODEL, SIZE)


def batches(steps: int) -> list:
    return [example_batch(cfg(), BATCH, seed=s) for s in range(steps)]


def _timed_exchanges(calls: list) -> None:
    """Every `Comm.all_to_all` this process makes lands its seconds in
    `calls` (the executor's comm is built after this)."""
    real = Comm.all_to_all

    def timed(self, flat, sizes, counts, group):
        t0 = time.perf_counter()
        out = real(self, flat, sizes, counts, group)
        calls.append(time.perf_counter() - t0)
        return out
    Comm.all_to_all = timed  # type: ignore[method-assign]


def _rank(rank: int, port: int, out: str, name: str, job_path: str, steps: int) -> None:
    join_group(rank, port, WORLD)
    calls: list = []
    _timed_exchanges(calls)
    ex, state = meshplan_rank(job_path, rank, CPU, cfg())

    def step(b):
        return float(torch.stack(ex.step(state, split_microbatches(b, 1))).mean())

    losses, times = timed_steps(step, batches(steps), CPU)
    a2a, per_step = [], 0
    for b in batches(PROFILE_STEPS):
        calls.clear()
        step(b)
        a2a.append(sum(calls))
        per_step = len(calls)
    experts = sum(t.numel() * t.element_size() for n, t in state.items()
                  if t is not None and "@" not in n and is_expert_param(n))
    write_rank(out, rank, {"losses": losses, "step_s": times, "a2a_s": a2a,
                           "a2a_calls": per_step, "expert_bytes": experts,
                           "executor_peak": ex.mem.peak,
                           "planned": dict(ex.plan.memory.peak)})
    dist.destroy_process_group()


def plan_jobs(folder: str) -> tuple[dict[str, str], dict[str, dict]]:
    """Each configuration's Job, captured afresh (a cache of its own: the
    fused and the unfused graphs are two captures of one model)."""
    paths, reports, fuse = {}, {}, export.fuse_routed_experts
    for name, (fields, fused) in CONFIGS.items():
        os.environ["MESHPLAN_CACHE_DIR"] = str(Path(folder, f"cache-{name}"))
        export.fuse_routed_experts = fuse if fused else (lambda g: g)
        try:
            s = zoo_strategy(MODEL, cfg(), global_batch_size=BATCH, micro_batch_size=MICRO,
                             **fields)
            job = plan_model(MODEL, SIZE, Mesh(1, WORLD), s, "sgd").job
        finally:
            export.fuse_routed_experts = fuse
            del os.environ["MESHPLAN_CACHE_DIR"]
        paths[name] = p = str(Path(folder, f"{name}.bin"))
        write_atomic(Path(p), job.to_bytes())
        reports[name] = {"experts": report(job).experts or {}, "notes": list(job.notes)}
    return paths, reports


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-moe-hf-") as folder:
        paths, reports = plan_jobs(folder)
        runs = alternate({n: (lambda n=n: spawn_ranks(_rank, (n, paths[n], a.steps), WORLD))
                          for n in CONFIGS}, a.rounds)
    res: dict = {"machine": machine(), "steps": a.steps, "rounds": a.rounds, "configs": {}}
    for name, r in runs.items():
        rounds = [[max(ts) for ts in zip(*(rk["step_s"] for rk in rnd))] for rnd in r["rounds"]]
        first = r["rounds"][0]
        res["configs"][name] = {
            "step_s": timed_median(rounds), "best_round_s": best_round(rounds),
            "losses": first[0]["losses"], "report": reports[name],
            "a2a_s": median([s for rnd in r["rounds"] for rk in rnd for s in rk["a2a_s"]]),
            "a2a_calls_per_step": first[0]["a2a_calls"],
            "expert_bytes_per_rank": first[0]["expert_bytes"],
            "executor_peak": max(rk["executor_peak"] for rk in first),
            "planned_peak": first[0]["planned"], "busy_before": r["busy_before"]}
    c = res["configs"]
    res["ep2_vs_ep2_ops_step"] = c["ep2"]["step_s"] / c["ep2-ops"]["step_s"]
    res["dp2_vs_dp2_ops_step"] = c["dp2"]["step_s"] / c["dp2-ops"]["step_s"]
    res["ep2_vs_dp2_step"] = c["ep2"]["step_s"] / c["dp2"]["step_s"]
    res["max_loss_diff"] = max(max_diff(c[n]["losses"], c["dp2"]["losses"]) for n in c)
    table = (
        "# transformers' Mixtral small: routed experts against the block as its ops, "
        "2 gloo processes (CPU)\n\n"
        f"{a.rounds} rounds x {a.steps} steps, alternating; medians after {WARMUP} warm-up "
        "steps. `-ops`: the expert blocks left as captured (each rank runs them on the "
        "whole micro-batch; at ep2 the expert weights gathered too), as before the fusion.\n\n"
        "| | step (ms) | best round (ms) | expert weights / rank (MiB) | planned peak / rank "
        "(MiB) | measured peak of its values (MiB) | all-to-all calls / step | "
        "all-to-all (ms / step) |\n"
        "|---|---|---|---|---|---|---|---|\n"
        + "".join(
            f"| {n} | {x['step_s'] * 1e3:.0f} | {x['best_round_s'] * 1e3:.0f} | "
            f"{_mib(x['expert_bytes_per_rank'])} | {_mib(x['planned_peak']['total'])} | "
            f"{_mib(x['executor_peak'])} | {x['a2a_calls_per_step']} | "
            f"{x['a2a_s'] * 1e3:.1f} |\n"
            for n, x in c.items())
        + f"\nep2 / ep2-ops step: {res['ep2_vs_ep2_ops_step']:.2f}x; dp2 / dp2-ops: "
        f"{res['dp2_vs_dp2_ops_step']:.2f}x; ep2 / dp2: {res['ep2_vs_dp2_step']:.2f}x; "
        f"max loss |diff| to dp2 {res['max_loss_diff']:.1e}.\n")
    write("moe_hf", res, table)


if __name__ == "__main__":
    main()
