"""`--auto`: the search's choice for the planning verbs, and `plan --auto`'s table.

Invariants:
- `strategy_of(a, cfg)` is how every planning verb gets its Strategy: the
  flags' own, or with `--auto` the search's winner (dp, tp, pp, vpp,
  schedule, micro-batch, recompute, ZeRO level and layers per virtual
  stage, ep for a mixture of experts, cp when nothing fits without and
  sequence parallelism with tp > 1, unless `--ep`, `--cp` or
  `--sequence-parallel` fixes it), keeping
  the flags' mesh, global batch, precision and buckets.
- The search runs once per command; a user mistake (unknown device model,
  a memory limit nothing fits, a mesh the model cannot use) is one
  ConfigError line.
"""

from __future__ import annotations

import argparse
import sys

from meshplan.cli.auto_flags import parse_bytes
from meshplan.cli.config_name import format_config_name
from meshplan.cli.flags import mesh_of, optimizer_config, overrides, strategy_fields
from meshplan.costmodel import load_device_model
from meshplan.driver.plan import zoo_strategy
from meshplan.errors import ConfigError
from meshplan.ir.mesh import Strategy
from meshplan.passes.expert_parallel import check_ep_divides
from meshplan.search.probe import ModelSpec
from meshplan.search.search import search
from meshplan.search.space import Space


def run_search(a: argparse.Namespace):
    """The search over the flags' model and mesh, its winner (`ranked[0]`)
    proven by its full plan: (SearchResult, DeviceModel, limit)."""
    dev = load_device_model(a.device_model or "cpu-local")
    limit = parse_bytes(a.memory_per_device) if a.memory_per_device else dev.memory_bytes
    spec = ModelSpec(a.model, a.size, tuple(sorted(overrides(a).items())),
                     optimizer_config(a) if hasattr(a, "optimizer") else "adamw",
                     str(a.precision))
    ep = getattr(a, "ep", 1)
    if ep > 1 and not spec.experts:
        raise ConfigError(f"--ep {ep} with --auto: --model {a.model} has no experts; drop --ep")
    check_ep_divides(spec.experts or 1, ep)
    cp = getattr(a, "cp", 1)
    if cp > 1 and not spec.seq:
        raise ConfigError(f"--cp {cp} with --auto: --model {a.model} has no sequence to split; "
                          "drop --cp")
    sp = getattr(a, "sequence_parallel", False)
    if sp and not spec.seq:
        raise ConfigError(f"--sequence-parallel with --auto: --model {a.model} has no sequence "
                          "to split; drop --sequence-parallel")
    # --ep, --cp and --sequence-parallel fix theirs (sp: the winner has tp > 1);
    # else the search chooses (cp when nothing fits without)
    space = Space(eps=(ep,) if ep > 1 else (), seq=spec.seq if cp > 1 else 0,
                  cps=(cp,) if cp > 1 else (), **({"sps": (True,)} if sp else {}))
    gbs = a.global_batch_size or a.default_gbs
    return search(spec, mesh_of(a), gbs, dev, memory_limit=limit, space=space,
                  bucket_mb=a.bucket_mb), dev, limit


def strategy_of(a: argparse.Namespace, cfg) -> Strategy:
    """The Strategy the flags say, or with --auto the search's winner."""
    if not getattr(a, "auto", False):
        return zoo_strategy(a.model, cfg, **strategy_fields(a))
    res, dev, _ = run_search(a)
    r, full = res.winner, res.proven
    assert full is not None
    if not getattr(a, "quiet", False):
        print(f"--auto chose {r.cand.label()} on {dev.name} (simulated step "
              f"{full.step_s:.4g} s, planned peak {max(full.peak) / 2**30:.2f} GiB; "
              f"{res.considered} strategies searched in {res.seconds - res.proof_s:.1f} s, "
              f"proven in {res.proof_s:.1f} s)", file=sys.stderr)
    return winner_strategy(a, cfg, r)


def winner_strategy(a: argparse.Namespace, cfg, ranked) -> Strategy:
    return zoo_strategy(a.model, cfg, **fields_of(a, ranked))


def fields_of(a: argparse.Namespace, ranked) -> dict:
    """The Strategy fields of a ranked candidate, under the flags' batch and precision."""
    c = ranked.cand
    return {"dp": c.dp, "tp": c.tp, "pp": c.pp, "vpp": c.vpp, "ep": c.ep, "cp": c.cp,
            "sequence_parallel": c.sp, "schedule": c.schedule,
            "global_batch_size": a.global_batch_size or a.default_gbs,
            "micro_batch_size": c.micro_batch_size, "recompute": c.recompute,
            "zero": c.zero, "precision": a.precision, "bucket_mb": a.bucket_mb,
            "stage_layers": ranked.pred.stage_layers if c.pp > 1 else ()}


def config_name(a: argparse.Namespace, cfg, ranked) -> str:
    return format_config_name(fields_of(a, ranked) | {
        "model": a.model, "layers": cfg.layers, "heads": cfg.heads, "hidden": cfg.hidden,
        "nodes": a.nodes, "devices_per_node": a.devices_per_node})


def table_json(a: argparse.Namespace, cfg, res, dev, limit: int) -> dict:
    full = res.proven
    rows = []
    for r in res.ranked:
        f = fields_of(a, r)
        rows.append({**{k: str(v) if k in ("schedule", "recompute", "precision") else v
                        for k, v in f.items()},
                     "stage_layers": list(f["stage_layers"]), "strategy": r.cand.label(),
                     "step_s": r.pred.step_s, "tflops_per_device": r.pred.tflops(),
                     "bubble_ratio": r.pred.bubble, "peak_bytes": list(r.pred.peak),
                     "config_name": config_name(a, cfg, r)})
    rows[0] |= {"winner": True, "planned_step_s": full.step_s,
                "planned_peak_bytes": list(full.peak)}
    return {"device_model": dev.name, "memory_limit_bytes": limit, "search_s": res.seconds,
            "candidates": res.considered, "over_memory": res.over_memory,
            "refused": sum(res.refused.values()), "simulated": res.simulated,
            "probes": res.probes, "full_plans": res.proofs, "proof_s": res.proof_s,
            "over_when_planned": res.over_when_planned, "unproven": res.unproven, "top": rows}


def print_table(t: dict) -> None:
    print(f"searched {t['candidates']} strategies in {t['search_s'] - t['proof_s']:.1f} s on "
          f"{t['device_model']} ({t['probes']} layer probes planned, {t['over_memory']} over "
          f"{t['memory_limit_bytes'] / 2**30:.1f} GiB, {t['refused']} refused by the "
          f"planner, {t['simulated']} simulated), then proved the winner in "
          f"{t['proof_s']:.1f} s")
    head = f"{'#':>2}  {'strategy':<40} {'step (s)':>9} {'TFLOP/s':>8} {'bubble':>7} " \
           f"{'peak GiB per stage':<22} config"
    print(head)
    for i, row in enumerate(t["top"], 1):
        peaks = [p / 2**30 for p in row["peak_bytes"]]
        shown = ", ".join(f"{p:.1f}" for p in peaks[:3]) + (", ..." if len(peaks) > 3 else "")
        print(f"{i:>2}  {row['strategy']:<40} {row['step_s']:>9.4g} "
              f"{row['tflops_per_device']:>8.3g} {row['bubble_ratio']:>7.3f} {shown:<22} "
              f"{row['config_name']}")
    best = t["top"][0]
    layers = ",".join(map(str, best["stage_layers"]))
    faster = (f"; {t['over_when_planned']} faster ones did not fit once planned"
              if t["over_when_planned"] else "")
    skipped = (f"; {t['unproven']} that might fit were not planned (at most "
               f"{t['full_plans']} full plans)" if t["unproven"] else "")
    print(f"winner #1, proven by its full plan: step {best['planned_step_s']:.4g} s, "
          f"planned peak {max(best['planned_peak_bytes']) / 2**30:.2f} GiB "
          f"({t['full_plans']} full plan(s){faster}{skipped}); "
          "the rest are estimates")
    ep = "".join(f"--{k} {best[k]} " for k in ("ep", "cp") if best[k] > 1)
    print(f"  --dp {best['dp']} --tp {best['tp']} --pp {best['pp']} --vpp {best['vpp']} {ep}"
          f"--schedule {best['schedule']} --micro-batch-size {best['micro_batch_size']} "
          f"--recompute {best['recompute']} --zero {best['zero']}"
          + (f" --stage-layers {layers}" if layers else ""))
