"""The `show` verb: what a plan directory holds, rank by rank, and the
pipeline grid; optionally the simulated step as a Chrome/Perfetto trace and
as a picture."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from meshplan.cli.pictures import draw_schedule, rows_of
from meshplan.errors import ConfigError
from meshplan.ir.fileio import write_atomic
from meshplan.lowering.check import simulate_plans
from meshplan.lowering.files import read_dir
from meshplan.schedules import stage_placement
from meshplan.schedules.csv_io import dump_csv
from meshplan.schedules.grid import format_grid
from meshplan.schedules.simulate import chrome_trace, spans_of


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def summary(plan) -> dict:
    """Tasks by kind, buffers, planned peak by category and peers of one rank."""
    peers = {t.peer for t in plan.tasks if t.peer >= 0}
    peers |= {r for t in plan.tasks for r in t.group}
    peers.discard(plan.rank)
    return {"rank": plan.rank, "stage": plan.stage, "coord": list(plan.coord),
            "tasks": dict(Counter(t.kind.value for t in plan.tasks)),
            "buffers": len(plan.buffers), "planned_peak": dict(plan.memory.peak),
            "peers": sorted(peers), "actions": len(plan.actions)}


def simulated(job, plans):
    """The step simulated on the cost model; a user error when it cannot be."""
    sim = simulate_plans(job, plans)
    if sim is None:
        raise ConfigError("the plan directory lacks a stage's plans; compile every rank "
                          "(no --ranks) to simulate or draw the step")
    return sim


def schedule_png(job, plans, path: str | Path) -> dict:
    """Draw the simulated step of `plans` at `path` (one row per rank)."""
    sim = simulated(job, plans)
    by_stage: dict[int, list[int]] = {}
    for r, p in sorted(plans.items()):
        by_stage.setdefault(p.stage, []).append(r)
    s = job.strategy
    title = (f"one training step, simulated on the cost model: {s.schedule}, pp={s.pp} "
             f"vpp={s.vpp} "
             f"dp={s.dp} tp={s.tp}, {s.num_microbatches} micro-batches, "
             f"bubble ratio {sim.bubble_ratio:.2f}")
    draw_schedule(rows_of(spans_of(sim), by_stage), stage_placement(s), path, title)
    return {"path": str(path), "bubble_ratio": sim.bubble_ratio, "step_s": sim.step_time}


def cmd_show(a: argparse.Namespace) -> int:
    job, plans = read_dir(Path(a.dir))
    if a.rank is not None and a.rank not in plans:
        raise ConfigError(f"--rank {a.rank} is not in {a.dir} (ranks 0..{len(plans) - 1})")
    shown = [plans[a.rank]] if a.rank is not None else [plans[r] for r in sorted(plans)]
    rows = [summary(p) for p in shown]
    if a.trace:
        sim = simulated(job, plans)
        write_atomic(Path(a.trace), json.dumps(chrome_trace(sim, unit_us=1e6)).encode())
    png = schedule_png(job, plans, a.png) if a.png else None
    if a.csv_comm and not a.csv:
        raise ConfigError("--csv-comm says what --csv writes; give --csv FILE too")
    if a.csv:
        write_atomic(Path(a.csv), schedule_csv(job, plans, a.csv_comm).encode())
    if a.json:
        print(json.dumps({"ranks": rows, "trace": a.trace or None, "png": png,
                          "csv": a.csv or None}))
        return 0
    for r in rows:
        peak = r["planned_peak"]
        cats = ", ".join(f"{k} {_mib(v)}" for k, v in peak.items() if k != "total")
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["tasks"].items()))
        print(f"rank {r['rank']} (stage {r['stage']}, grid {tuple(r['coord'])}): {kinds}; "
              f"{r['buffers']} buffers; peak {_mib(peak['total'])} MiB ({cats}); "
              f"peers {r['peers'][:8]}{' ...' if len(r['peers']) > 8 else ''}")
    stages = {}
    for p in shown:
        stages.setdefault(p.stage, p.actions)
    print("\npipeline grid (one column per stage; actions <stage><F|B|I|W><micro-batch>):")
    print(format_grid(stages, max_rows=64))
    if a.trace:
        print(f"\nwrote {a.trace} (simulated step; open it in Perfetto or chrome://tracing)")
    if png:
        print(f"wrote {a.png} (the simulated step drawn, one row per rank)")
    if a.csv:
        print(f"wrote {a.csv} (each pipeline rank's "
              f"{'actions' if a.csv_comm else 'compute actions'}, torch's pipeline CSV)")
    return 0


def schedule_csv(job, plans, comm: bool) -> str:
    """One row per pipeline rank (its stage's actions, from the lowest rank's
    plan), compute-only unless `comm`, in torch's pipeline CSV format."""
    stages: dict[int, list] = {}
    for _, p in sorted(plans.items()):
        stages.setdefault(p.stage, [a for a in p.actions if comm or not a.type.is_comm])
    if sorted(stages) != list(range(job.strategy.pp)):
        raise ConfigError("--csv writes every pipeline rank's row, but the plan directory "
                          "lacks a stage's plans; compile every rank (no --ranks)")
    return dump_csv(stages)
