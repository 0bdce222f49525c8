"""Pipeline schedules: meshplan's 1f1b, interleaved, zb1p and zbv beside
torch.distributed.pipelining's Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble.

GPT (8 layers, hidden 128, 4 heads, seq 64, vocab 1024), global batch 16 as
4 micro-batches of 4, pp=2, SGD, one thread per process; CPU and gloo over
127.0.0.1 (`--device cuda`: one GPU per rank, nccl). vpp is 1 for 1f1b and 2
for the others. Stage placements are torch's (rank r holds stages r and
r+pp; for zbv, a V: r and 2*pp-1-r); meshplan's plans are checked to hold
the same stages. Both systems train the same weights on the same batches.

Measured, per configuration:
- step time: the median, over rounds, of the steps after the warm-up, each
  timed between barriers (the pipeline's time); one run per configuration
  per round, configurations alternating (`common.alternate`);
- bubble ratio per rank, from one traced step after the timed ones:
  1 - (seconds in compute: F, B, I, W, and torch's loss_fn, which meshplan's
  F holds) / the step's wall time (the slowest rank's); meshplan's spans are
  its executor's (`harness.profiled_step`), torch's come from timers around
  each stage's forward_one_chunk, backward_one_chunk and
  backward_weight_one_chunk (`common.TorchPipeline`); median over rounds;
- peak memory per rank, from one more run of 2 steps: on the CPU the bytes
  of live storages (`common.LiveStorages`, on from before the model is
  built) during the second step, for both systems; on a GPU the allocator's
  peak; for meshplan also its executor's live bytes and its plan's peak;
- for meshplan, the bubble its simulator predicts for the same plans
  (`simulate_plans`, op cost model), by the same formula.
Losses must agree across all configurations (max |diff| <= LOSS_TOLERANCE);
if not, the results are written and the script exits 1.

Targets: meshplan zbv / torch ScheduleZBVZeroBubble <= 1.0; meshplan zb1p /
torch ScheduleInterleavedZeroBubble <= 1.0; meshplan zbv's measured bubble
lower than 1f1b's and interleaved's by at least half the simulator's
predicted difference. Each meshplan schedule is also reported against torch
ScheduleInterleaved1F1B. A missed target prints where each step's time goes.

Run: python benchmarks/pipeline_schedules.py [--steps K] [--rounds R] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    BATCH,
    LOSS_SPAN,
    LOSS_TOLERANCE,
    SHAPE,
    WARMUP,
    LiveStorages,
    TorchPipeline,
    alternate,
    batches,
    best_round,
    cfg,
    join_group,
    machine,
    max_diff,
    median,
    meshplan_rank,
    spawn_ranks,
    sync,
    timed_median,
    timed_steps,
    write,
    write_rank,
)
from harness import phase_seconds, profiled_step  # noqa: E402

from meshplan.driver.plan import plan_model, zoo_strategy  # noqa: E402
from meshplan.driver.reference import split_microbatches  # noqa: E402
from meshplan.errors import ConfigError  # noqa: E402
from meshplan.ir.fileio import write_atomic  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.lowering.check import simulate_plans  # noqa: E402
from meshplan.lowering.lower import lower  # noqa: E402
from meshplan.runtime.devices import resolve_backend, resolve_device  # noqa: E402
from meshplan.schedules.trace import Span, action_of  # noqa: E402

PP, MICRO = 2, 4
M = BATCH // MICRO
MiB = 2 ** 20
# meshplan's schedule: (vpp, torch's schedule class, torch's stage placement style)
SCHEDULES = {"1f1b": (1, "Schedule1F1B", "loop"),
             "interleaved": (2, "ScheduleInterleaved1F1B", "loop"),
             "zb1p": (2, "ScheduleInterleavedZeroBubble", "loop"),
             "zbv": (2, "ScheduleZBVZeroBubble", "v")}
SYSTEMS = ("meshplan", "torch")


@dataclass(frozen=True, slots=True)
class Config:
    """One row: a system and a schedule (a key of SCHEDULES)."""

    system: str
    schedule: str

    @property
    def key(self) -> str:
        return f"{self.system}_{self.schedule}"

    @property
    def vpp(self) -> int:
        return SCHEDULES[self.schedule][0]

    @property
    def label(self) -> str:
        if self.system == "meshplan":
            return f"meshplan {self.schedule} (vpp {self.vpp})"
        return f"torch {SCHEDULES[self.schedule][1]}"


CONFIGS = [Config(system, s) for system in SYSTEMS for s in SCHEDULES]


def stage_ids(schedule: str, rank: int) -> list[int]:
    """The virtual stages torch places on `rank` for `schedule`."""
    vpp, _, style = SCHEDULES[schedule]
    where = generate_stage_to_rank_mapping(PP, PP * vpp, style=style)
    return sorted(s for s, r in where.items() if r == rank)


# ------------------------------------------------------------------ meshplan
def meshplan_job(schedule: str):
    s = zoo_strategy("gpt", cfg(), pp=PP, vpp=SCHEDULES[schedule][0], global_batch_size=BATCH,
                     micro_batch_size=MICRO, schedule=schedule)
    return plan_model("gpt", "tiny", Mesh(1, PP), s, "sgd", **SHAPE).job


def predicted(job, plans: dict) -> dict:
    """The simulator's step on `plans`: its step time and, per rank, 1 -
    (compute seconds) / step time."""
    sim = simulate_plans(job, plans)
    if sim is None or not sim.ok:
        raise SystemExit(f"meshplan's simulator cannot run the plans: {sim and sim.deadlock}")
    busy = {r: sum(end - start for a, start, end in spans if a.type.is_compute)
            for r, spans in sim.timeline.items()}
    return {"step_s": sim.step_time, "bubble": [1 - busy[r] / sim.step_time for r in sorted(busy)]}


def check_placement(schedule: str, plans: dict) -> None:
    """meshplan's plans run, on each rank, the stages torch places there."""
    for r, p in sorted(plans.items()):
        held = sorted({a.virtual_stage for a in p.actions if a.type.is_compute})
        if held != stage_ids(schedule, r):
            raise SystemExit(f"meshplan {schedule}: rank {r} runs stages {held}, torch's "
                             f"placement has {stage_ids(schedule, r)}")


def prepare(config: Config, device: str, folder: str) -> dict:
    """A meshplan config's Job (written under `folder`), its plans' peaks and
    the simulator's prediction."""
    job = meshplan_job(config.schedule)
    plans = {r: lower(job, r, device) for r in range(PP)}
    check_placement(config.schedule, plans)
    path = Path(folder, f"{config.key}.job")
    write_atomic(path, job.to_bytes())
    return {"job_path": str(path), "predicted": predicted(job, plans),
            "planned_peak_bytes": [plans[r].memory.peak_bytes() for r in range(PP)]}


class MeshplanPipeline:
    """meshplan's executor of one rank, with the step interface of TorchPipeline."""

    def __init__(self, job_path: str, rank: int, device: torch.device):
        self.ex, self.state = meshplan_rank(job_path, rank, device)

    def step(self, batch) -> float | None:
        out = self.ex.step(self.state, split_microbatches(batch, M))
        return float(torch.stack(out).mean()) if out else None

    def traced_step(self, batch) -> tuple[float, list[Span]]:
        return profiled_step(self.ex, self.state, split_microbatches(batch, M))


# ------------------------------------------------------------------ a rank
def pipeline(config: Config, rank: int, job_path: str, device: torch.device):
    if config.system == "meshplan":
        return MeshplanPipeline(job_path, rank, device)
    vpp, schedule, _ = SCHEDULES[config.schedule]
    return TorchPipeline(schedule, stage_ids(config.schedule, rank), PP * vpp, MICRO, M, device)


def _timed(pipe, steps: int, device: torch.device) -> dict:
    """`steps` timed steps, then one traced step (its own batch)."""
    data = batches(steps + 1)
    losses, times = timed_steps(pipe.step, data[:steps], device)
    dist.barrier()
    wall, spans = pipe.traced_step(data[steps])
    return {"losses": losses, "step_s": times,
            "traced": {"wall_s": wall, "spans": [s.to_json() for s in spans]}}


def _memory(config: Config, rank: int, job_path: str, device: torch.device) -> dict:
    """Peak bytes during the second of two steps, counted from before the
    model is built (CPU: live storages; GPU: the allocator's peak)."""
    data = batches(2)
    live = LiveStorages() if device.type == "cpu" else None
    with live if live is not None else nullcontext():
        pipe = pipeline(config, rank, job_path, device)
        pipe.step(data[0])
        sync(device)
        if live is not None:
            live.reset_peak()
        else:
            torch.cuda.reset_peak_memory_stats(device)
        pipe.step(data[1])
        sync(device)
    out = {"peak_bytes": live.peak if live is not None else torch.cuda.max_memory_allocated(device)}
    if isinstance(pipe, MeshplanPipeline):
        out["executor_peak_bytes"] = pipe.ex.mem.peak
    return out


def _rank(rank: int, port: int, out: str, config: Config, job_path: str, device: str,
          steps: int, memory: bool) -> None:
    dev = join_group(rank, port, PP, device)
    if memory:
        write_rank(out, rank, _memory(config, rank, job_path, dev))
    else:
        write_rank(out, rank, _timed(pipeline(config, rank, job_path, dev), steps, dev))
    dist.destroy_process_group()


def run_config(config: Config, job_path: str, device: str, steps: int,
               memory: bool = False) -> list[dict]:
    return spawn_ranks(_rank, (config, job_path, device, steps, memory), PP)


# ------------------------------------------------------------------ summaries
def is_compute(span: Span) -> bool:
    """F, B, I, W, and torch's loss_fn (inside meshplan's F)."""
    a = action_of(span)
    return span.name == LOSS_SPAN or (a is not None and a.type.is_compute)


def bubbles(ranks: list[dict]) -> list[float]:
    """Per rank, 1 - compute seconds / the traced step's wall time (the slowest rank's)."""
    wall = max(r["traced"]["wall_s"] for r in ranks)
    return [1 - sum(s.end - s.start for s in map(Span.from_json, r["traced"]["spans"])
                    if is_compute(s)) / wall for r in ranks]


def phases(rounds: list[list[dict]]) -> list[dict]:
    """Per rank, mean seconds per traced step in each phase (`harness.phase_seconds`)."""
    return [phase_seconds([(run[r]["traced"]["wall_s"],
                            [Span.from_json(x) for x in run[r]["traced"]["spans"]])
                           for run in rounds]) for r in range(PP)]


def summary(rounds: list[list[dict]], memory: list[dict], prep: dict) -> dict:
    """One configuration's numbers from its rounds (each: per-rank results)."""
    steps = [[max(r["step_s"][i] for r in run) for i in range(len(run[0]["step_s"]))]
             for run in rounds]
    per_round = [bubbles(run) for run in rounds]
    out = {"median_step_s": timed_median(steps), "best_round_step_s": best_round(steps),
           "step_s": steps, "bubble": [median([b[r] for b in per_round]) for r in range(PP)],
           "bubble_per_round": per_round, "phases_s": phases(rounds),
           "losses": next(r["losses"] for r in rounds[0] if r["losses"]),
           "peak_bytes": [m["peak_bytes"] for m in memory]}
    if "predicted" in prep:
        out |= {"predicted": prep["predicted"], "planned_peak_bytes": prep["planned_peak_bytes"],
                "executor_peak_bytes": [m["executor_peak_bytes"] for m in memory]}
    return out


def measure(prep: dict, device: str, steps: int, rounds: int) -> dict:
    """Every configuration `rounds` times, alternating, then one memory run
    each; `prep` holds meshplan's (`prepare`)."""
    paths = {c.key: prep.get(c.key, {}).get("job_path", "") for c in CONFIGS}
    runs = alternate({c.key: partial(run_config, c, paths[c.key], device, steps)
                      for c in CONFIGS}, rounds)
    out = {}
    for c in CONFIGS:
        memory = run_config(c, paths[c.key], device, 2, memory=True)
        out[c.key] = summary(runs[c.key]["rounds"], memory, prep.get(c.key, {}))
        out[c.key]["busy_before"] = runs[c.key]["busy_before"]
    return out


def losses_check(res: dict) -> dict:
    """Every configuration's losses against the first one's."""
    first = next(iter(res))
    diffs = {k: max_diff(v["losses"], res[first]["losses"]) for k, v in res.items()}
    return {"reference": first, "tolerance": LOSS_TOLERANCE, "max_abs_diff": diffs,
            "agree": max(diffs.values()) <= LOSS_TOLERANCE,
            "per_step": {k: v["losses"] for k, v in res.items()}}


# ------------------------------------------------------------------ targets
def _ratio_target(res: dict, mine: str, theirs: str) -> dict:
    value = res[mine]["median_step_s"] / res[theirs]["median_step_s"]
    return {"value": value, "target": 1.0, "met": value <= 1.0,
            "best_rounds": res[mine]["best_round_step_s"] / res[theirs]["best_round_step_s"]}


def _bubble_target(res: dict, other: str) -> dict:
    """zbv's measured bubble below `other`'s by at least half the predicted drop
    (largest over ranks)."""
    zbv = "meshplan_zbv"
    measured = max(res[other]["bubble"]) - max(res[zbv]["bubble"])
    predicted = (max(res[other]["predicted"]["bubble"])
                 - max(res[zbv]["predicted"]["bubble"]))
    return {"measured_drop": measured, "predicted_drop": predicted,
            "met": measured >= predicted / 2}


def targets(res: dict) -> dict:
    return {"meshplan zbv / torch ScheduleZBVZeroBubble <= 1.0":
            _ratio_target(res, "meshplan_zbv", "torch_zbv"),
            "meshplan zb1p / torch ScheduleInterleavedZeroBubble <= 1.0":
            _ratio_target(res, "meshplan_zb1p", "torch_zb1p"),
            "meshplan zbv bubble below 1f1b's by >= half the predicted drop":
            _bubble_target(res, "meshplan_1f1b"),
            "meshplan zbv bubble below interleaved's by >= half the predicted drop":
            _bubble_target(res, "meshplan_interleaved")}


def vs_torch_interleaved(res: dict) -> dict:
    base = res["torch_interleaved"]["median_step_s"]
    return {k: v["median_step_s"] / base for k, v in res.items() if k.startswith("meshplan")}


# ------------------------------------------------------------------ report
def _per_rank(xs: list, fmt: str) -> str:
    return " / ".join(format(x, fmt) for x in xs)


def _mib(xs: list[int]) -> str:
    return _per_rank([x / MiB for x in xs], ".1f")


def _row(c: Config, res: dict, ratio: dict) -> str:
    r = res[c.key]
    pred = _per_rank(r["predicted"]["bubble"], ".3f") if "predicted" in r else "-"
    own = [_mib(r[k]) if k in r else "-" for k in ("executor_peak_bytes", "planned_peak_bytes")]
    vs = f"{ratio[c.key]:.3f}" if c.key in ratio else "-"
    return (f"| {c.label} | {r['median_step_s'] * 1e3:.1f} | {r['best_round_step_s'] * 1e3:.1f} "
            f"| {vs} | {_per_rank(r['bubble'], '.3f')} | {pred} | "
            f"{_mib(r['peak_bytes'])} | {own[0]} | {own[1]} |")


def _target_line(name: str, t: dict) -> str:
    verdict = "met" if t["met"] else "NOT met"
    if "value" in t:
        return f"- {name}: {t['value']:.3f}, {verdict} (best rounds: {t['best_rounds']:.3f})"
    return (f"- {name}: measured drop {t['measured_drop']:.3f} vs predicted "
            f"{t['predicted_drop']:.3f}, {verdict}")


def phase_lines(res: dict) -> list[str]:
    """Where each configuration's traced step goes, per rank (ms)."""
    lines = []
    for c in CONFIGS:
        ranks = [f"rank {r} " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ph.items())
                 for r, ph in enumerate(res[c.key]["phases_s"])]
        lines.append(f"- {c.label}: " + "; ".join(ranks) + ".")
    return lines


def table(a, res: dict, tg: dict, loss: dict, load: list) -> str:
    ratio = vs_torch_interleaved(res)
    memory = "live storages" if a.device == "cpu" else "allocator peak"
    lines = [f"Pipeline schedules: GPT 8x128 (seq 64, vocab 1024), global batch {BATCH} as {M} "
             f"micro-batches of {MICRO}, pp={PP}, SGD, 1 thread per process, {a.device}; median "
             f"of {a.rounds} rounds x {a.steps - WARMUP} steps (each after {WARMUP} warm-up), "
             "configurations alternating by round, each started once the CPUs were quiet (or "
             "after 10 s); steps timed between barriers. Bubble = 1 - compute / wall of one "
             "traced step per round (median over rounds). Load average before/after: "
             f"{load[0]:.1f}/{load[1]:.1f} on {machine()['cpu_count']} CPUs.", "",
             "| configuration | median step (ms) | best round's median (ms) | "
             "vs torch interleaved | bubble measured r0 / r1 | bubble predicted r0 / r1 | "
             f"peak {memory} r0 / r1 (MiB) | meshplan executor's peak r0 / r1 (MiB) | "
             "planned peak r0 / r1 (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(c, res, ratio) for c in CONFIGS]
    lines += [""] + [_target_line(k, t) for k, t in tg.items()]
    lines.append("- each meshplan schedule / torch ScheduleInterleaved1F1B: " + ", ".join(
        f"{k.removeprefix('meshplan_')} {v:.3f}" for k, v in ratio.items()))
    agree = "agree" if loss["agree"] else "DISAGREE"
    lines.append(f"- losses, max |diff| vs {loss['reference']}: " + ", ".join(
        f"{k} {v:.1e}" for k, v in loss["max_abs_diff"].items()) + f" ({agree})")
    if not all(t["met"] for t in tg.values()):
        lines += ["", "Where a traced step's time goes, per rank (ms; other = no span: "
                  "waiting, and for torch its communication):", ""] + phase_lines(res)
    return "\n".join(lines) + "\n"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per configuration per "
                    f"round, the first {WARMUP} not counted (then one traced step)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: one GPU per rank, nccl")
    a = ap.parse_args()
    if a.steps <= WARMUP or a.rounds < 1:
        ap.error(f"--steps must be more than {WARMUP} and --rounds at least 1")
    try:
        resolve_backend(resolve_device(a.device), "", PP)
    except ConfigError as e:
        ap.error(str(e))
    return a


def main() -> None:
    a = parse_args()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="pipeline-schedules-") as folder:
        prep = {c.key: prepare(c, a.device, folder) for c in CONFIGS if c.system == "meshplan"}
        res = measure(prep, a.device, a.steps, a.rounds)
    load.append(os.getloadavg()[0])
    loss, tg = losses_check(res), targets(res)
    result = {"benchmark": "pipeline_schedules", "machine": machine(), "model": SHAPE,
              "global_batch": BATCH, "micro_batch": MICRO, "num_microbatches": M, "pp": PP,
              "device": a.device, "optimizer": "sgd", "warmup_steps": WARMUP,
              "steps": a.steps, "rounds": a.rounds, "configs": res, "targets": tg,
              "vs_torch_interleaved": vs_torch_interleaved(res),
              "losses": loss, "load_average_before_after": load}
    write("pipeline_schedules", result, table(a, res, tg, loss, load))
    if not loss["agree"]:
        raise SystemExit(f"losses disagree beyond {LOSS_TOLERANCE}: {loss['max_abs_diff']}")


if __name__ == "__main__":
    main()
