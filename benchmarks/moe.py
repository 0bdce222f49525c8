"""Expert parallelism: the zoo's MoE small at ep4 against ep1 (plain dp4),
and meshplan's all-to-alls against hand-written `all_to_all_single` calls
moving the same tokens.

Setup: `--model moe --size small` (8 layers, hidden 256, 8 heads, seq 128,
vocab 1024, 8 experts, top-2, dropless: each sample's capacity is its 128
tokens) on 4 gloo processes over 127.0.0.1, one thread each, CPU, SGD;
global batch 8 = 1 micro-batch x 2 samples x 4 ranks. Both configurations
train from seed 0 on the same batches (step k's from seed k).
- ep4: `Strategy(dp=4, ep=4)`: 2 of the 8 experts per rank, tokens
  dispatched and combined by the all-to-alls the boxing derives.
- dp4: `Strategy(dp=4)`: every rank holds every expert.

Measured:
- step time: the max over ranks of a step timed between barriers
  (`common.timed_steps`), the median over the rounds' steps after the
  warm-up; the two configurations alternate round by round
  (`common.alternate`), each once the CPUs are quiet.
- all-to-all (ep4), in 3 profiled steps after the timed ones: every
  all-to-all a rank runs, timed whole (cutting its parts,
  `all_to_all_single`, joining what arrives: the callable
  `runtime/bind.py` binds, wrapped here when the executor is built); and,
  right beside it in the step, the anchor on the very same input tensor
  (`_by_hand`: cut along the same dim, one
  `torch.distributed.all_to_all_single`, the parts joined as meshplan's
  output holds them). Each starts after a barrier, so that its time is the
  exchange's, not the wait for a peer the 2 shared cores have not
  scheduled; the two alternate which goes first. Both summed per step; the
  median over steps and ranks.
- bytes: the all-to-alls' logical bytes per step (`plan`'s report), and
  what each rank sends to others.
- memory per rank: the expert weights' bytes, and the plan's peak by
  category (`lower(job, rank).memory.peak`) beside the executor's own count.

Targets (met / NOT met): meshplan's all-to-all time <= 1.1x the anchor's;
the expert weights per rank at ep4 are 1/4 of dp4's; losses of ep4 equal
dp4's within 1e-5 (asserted after the results are written).

Run: python benchmarks/moe.py [--steps K] [--rounds R]
"""

from __future__ import annotations

import argparse
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

from meshplan.driver.job_report import report  # noqa: E402
from meshplan.driver.plan import plan_model, zoo_strategy  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.lowering.files import write_atomic  # noqa: E402
from meshplan.models import example_batch, model_config  # noqa: E402
from meshplan.passes.expert_parallel import is_expert_param  # noqa: E402
from meshplan.runtime import bind  # noqa: E402
from meshplan.runtime.data import split_microbatches  # noqa: E402

WORLD, BATCH, MICRO = 4, 8, 2
CPU = torch.device("cpu")
CONFIGS = {"ep4": dict(dp=WORLD, ep=WORLD), "dp4": dict(dp=WORLD)}
TARGET_A2A = 1.1
PROFILE_STEPS = 3


def cfg():
    return model_config("moe", "small")


def batches(steps: int) -> list:
    return [example_batch(cfg(), BATCH, seed=s) for s in range(steps)]


def _timed_all_to_all(calls: list, synced: dict) -> None:
    """Wrap the all-to-all callables `bind` makes (the executor is built
    after this), so each call's seconds land in `calls`. With
    `synced["on"]`, each call also runs the anchor on the very same input
    (`_by_hand`), at the same moment of the step, each after a barrier (so
    that each time is the exchange's own, not the wait for a late peer),
    the two in alternating order: `calls` gets (meshplan s, anchor s, the
    input's shape, dtype)."""
    make = bind._COLLECTIVES[bind.ALL_TO_ALL]

    def timed_make(op, kw, group, ctx, comm):
        run = make(op, kw, group, ctx, comm)

        def timed(x, **k):
            if not synced["on"]:
                return run(x, **k)
            first = len(calls) % 2 == 0
            if not first:
                hand = _timed(lambda: _by_hand(x, kw["src_dim"], kw["dst_dim"]))
            t, out = _timed(lambda: run(x, **k))
            if first:
                hand = _timed(lambda: _by_hand(x, kw["src_dim"], kw["dst_dim"]))
            calls.append((t, hand[0], tuple(x.shape), x.dtype))
            return out
        return timed
    bind._COLLECTIVES[bind.ALL_TO_ALL] = timed_make


def _timed(fn) -> tuple[float, object]:
    """(seconds, result) of `fn()`, started after a barrier."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _by_hand(x: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """The exchange written by hand: `x` cut into WORLD equal parts along
    `dst` (`movedim` to the front: a view where `dst` is 0 and `x`
    contiguous), one `all_to_all_single` into a preallocated output, and the
    parts received joined along `src`, as meshplan's output holds them."""
    part = list(x.shape)
    part[dst] //= WORLD
    send = x.movedim(dst, 0).reshape(WORLD, -1).contiguous()
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send)
    pieces = [p.reshape([part[dst]] + part[:dst] + part[dst + 1:]).movedim(0, dst)
              for p in out]
    return torch.cat(pieces, dim=src)


def _rank(rank: int, port: int, out: str, name: str, job_path: str, steps: int) -> None:
    join_group(rank, port, WORLD)
    calls: list = []
    synced = {"on": False}
    if name == "ep4":
        _timed_all_to_all(calls, synced)
    ex, state = meshplan_rank(job_path, rank, CPU, cfg())

    def step(b):
        return float(torch.stack(ex.step(state, split_microbatches(b, 1))).mean())

    losses, times = timed_steps(step, batches(steps), CPU)
    a2a, anchor = [], []
    if name == "ep4":  # profiled steps: each all-to-all and its anchor, at the same moment
        synced["on"] = True
        for b in batches(PROFILE_STEPS):
            calls.clear()
            step(b)
            a2a.append(sum(c[0] for c in calls))
            anchor.append(sum(c[1] for c in calls))
    sent = sum(torch.Size(c[2]).numel() * torch.empty((), dtype=c[3]).element_size()
               for c in calls) * (WORLD - 1) // WORLD
    experts = sum(t.numel() * t.element_size() for n, t in state.items()
                  if t is not None and "@" not in n and is_expert_param(n))
    write_rank(out, rank, {"losses": losses, "step_s": times, "a2a_s": a2a,
                           "anchor_s": anchor, "a2a_calls": len(calls),
                           "a2a_sent_bytes": sent, "expert_bytes": experts,
                           "executor_peak": ex.mem.peak,
                           "planned": dict(ex.plan.memory.peak)})
    dist.destroy_process_group()


def plan_jobs(folder: str) -> tuple[dict[str, str], dict[str, dict]]:
    paths, reports = {}, {}
    for name, fields in CONFIGS.items():
        s = zoo_strategy("moe", cfg(), global_batch_size=BATCH, micro_batch_size=MICRO,
                         **fields)
        job = plan_model("moe", "small", Mesh(1, WORLD), s, "sgd").job
        paths[name] = p = str(Path(folder, f"{name}.bin"))
        write_atomic(Path(p), job.to_bytes())
        reports[name] = report(job).experts or {}
    return paths, reports


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as folder:
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
            "a2a_s": median([s for rnd in r["rounds"] for rk in rnd for s in rk["a2a_s"]]
                            or [0.0]),
            "anchor_s": median([s for rnd in r["rounds"] for rk in rnd for s in rk["anchor_s"]]
                               or [1.0]),
            "a2a_calls_per_step": first[0]["a2a_calls"],
            "a2a_sent_bytes_per_rank": first[0]["a2a_sent_bytes"],
            "expert_bytes_per_rank": first[0]["expert_bytes"],
            "executor_peak": [rk["executor_peak"] for rk in first],
            "planned_peak": first[0]["planned"],
            "busy_before": r["busy_before"]}
    ep, dp = res["configs"]["ep4"], res["configs"]["dp4"]
    ratio = ep["a2a_s"] / ep["anchor_s"]
    res["a2a_vs_anchor"] = ratio
    res["a2a_target_met"] = ratio <= TARGET_A2A
    res["expert_bytes_ratio"] = ep["expert_bytes_per_rank"] / dp["expert_bytes_per_rank"]
    res["ep4_vs_dp4_step"] = ep["step_s"] / dp["step_s"]
    res["max_loss_diff"] = max_diff(ep["losses"], dp["losses"])
    met = "met" if res["a2a_target_met"] else "NOT met"
    table = (
        "# Expert parallelism: MoE small, 4 gloo processes (CPU)\n\n"
        f"{a.rounds} rounds x {a.steps} steps, alternating; medians after {WARMUP} warm-up "
        "steps.\n\n"
        "| | step (ms) | best round (ms) | expert weights / rank (MiB) | planned peak / rank "
        "(MiB) | all-to-all / step (MiB, logical) |\n|---|---|---|---|---|---|\n"
        + "".join(
            f"| {n} | {c['step_s'] * 1e3:.0f} | {c['best_round_s'] * 1e3:.0f} | "
            f"{_mib(c['expert_bytes_per_rank'])} | {_mib(c['planned_peak']['total'])} | "
            f"{_mib(c['report'].get('all_to_all_bytes_per_step', 0))} |\n"
            for n, c in res["configs"].items())
        + f"\nep4 / dp4 step time: {res['ep4_vs_dp4_step']:.2f}x; expert weights per rank "
        f"{res['expert_bytes_ratio']:.2f}x; max loss |diff| {res['max_loss_diff']:.1e}.\n\n"
        f"All-to-all at ep4, per step per rank ({ep['a2a_calls_per_step']} calls, "
        f"{_mib(ep['a2a_sent_bytes_per_rank'])} MiB sent to others): meshplan "
        f"{ep['a2a_s'] * 1e3:.1f} ms, hand-written `all_to_all_single` "
        f"{ep['anchor_s'] * 1e3:.1f} ms: {ratio:.2f}x (target <= {TARGET_A2A}: {met}).\n")
    write("moe", res, table)
    assert res["max_loss_diff"] <= 1e-5, res["max_loss_diff"]


if __name__ == "__main__":
    main()
