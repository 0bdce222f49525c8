"""The `compile` and `check` verbs."""

from __future__ import annotations

import argparse
import json

from meshplan.cli.auto_cmd import strategy_of
from meshplan.cli.flags import mesh_of, optimizer_config, overrides
from meshplan.driver.compile import compile_model
from meshplan.errors import ConfigError
from meshplan.lowering.check import spans
from meshplan.lowering.check_classes import check_dir
from meshplan.models import model_config
from meshplan.runtime.devices import resolve_device


def parse_ranks(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        out = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        return out
    except ValueError:
        raise ConfigError(f"--ranks '{text}' is not a list like 0,17 or 0-7") from None


def cmd_compile(a: argparse.Namespace) -> int:
    cfg = model_config(a.model, a.size, **overrides(a))
    strategy = strategy_of(a, cfg)
    ranks = parse_ranks(a.ranks)
    device = a.device
    if device == "best":  # lowering needs no GPU: only best asks this machine

        device = resolve_device("best")
    with a.progress.task("lowering ranks", len(ranks or range(mesh_of(a).world))) as update:
        stats = compile_model(a.model, a.size, mesh_of(a), strategy, a.out, optimizer_config(a),
                              lr=a.lr, ranks=ranks, workers=a.workers,
                              use_cache=not a.no_cache, progress=lambda done, _: update(done),
                              device=device, **overrides(a))
    if a.json:
        print(json.dumps(stats.to_json()))
        return 0
    ranks = stats.lowering.ranks
    lows = [v["lower_s"] for v in ranks.values()]
    hits = sum(1 for v in ranks.values() if v["cache_hit"])
    print(f"compiled {len(lows)} rank plans into {a.out} with {stats.lowering.workers} workers: "
          f"capture {stats.capture_s:.2f} s, master {stats.master_s:.2f} s, lowering "
          f"median {sorted(lows)[len(lows) // 2] * 1e3:.1f} ms, max {max(lows) * 1e3:.1f} ms "
          f"per rank ({hits} from cache){'' if device == 'cpu' else ', for ' + device}")
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    job, res = check_dir(a.dir)
    plans = res.ranks
    if a.json:
        print(json.dumps(res.to_json()))
        return 0 if res.ok else 1
    if res.partial:
        print(f"PARTIAL: {len(plans)} of {job.mesh.world} rank plans; missing ranks "
              f"{spans(res.missing)}; skipped: {', '.join(res.skipped) or 'nothing'}")
    if not res.ok:
        for e in res.errors:
            print(f"FAIL: {e}")
        return 1
    peaks = [v.planned_peak_bytes for v in res.ranks.values()]
    print(f"OK: {len(plans)} rank plans are consistent: unique ids, matched send/recv, "
          f"ordered collectives{'' if 'simulation' in res.skipped else ', no deadlock'}")
    step = "" if res.predicted_step_s is None else \
        f"predicted step {res.predicted_step_s * 1e3:.2f} ms, bubble ratio " \
        f"{res.bubble_ratio:.3f}, "
    print(f"{step}planned peak per rank {min(peaks) / 2**20:.2f}-{max(peaks) / 2**20:.2f} MiB")
    return 0
