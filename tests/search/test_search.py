"""The search: branch and bound returns what simulating everything does; its
winner is the full plans' winner; user mistakes are one line."""

import json
import subprocess
import sys

import pytest

from meshplan.costmodel import load_device_model
from meshplan.errors import ConfigError
from meshplan.ir.mesh import Mesh
from meshplan.search.estimate import Setting
from meshplan.search.full import evaluate, prove
from meshplan.search.probe import ModelSpec
from meshplan.search.search import _Pricer, search
from meshplan.search.space import Space, candidates

SPEC = ModelSpec("gpt", "tiny")
DEV = load_device_model("a100-80gb")
SMALL = Space(schedules=("1f1b", "interleaved", "zbv"), recompute=("none", "full"),
              zero=(0, 1, 3), micro_batch_sizes=(1, 2))


def test_pruning_returns_the_exhaustive_ranking():
    mesh = Mesh(1, 4)
    pruned = search(SPEC, mesh, 16, DEV, space=SMALL)
    every = search(SPEC, mesh, 16, DEV, space=SMALL, exhaustive=True)
    assert [r.cand for r in pruned.ranked] == [r.cand for r in every.ranked]
    assert pruned.simulated < every.simulated


def test_a_planted_loose_bound_breaks_pruning(monkeypatch):
    """A 'bound' above the simulated step prunes the true best: caught."""
    from meshplan.search import estimate

    mesh = Mesh(1, 4)
    every = search(SPEC, mesh, 16, DEV, space=SMALL, exhaustive=True)
    real = estimate.Priced.lower_bound
    monkeypatch.setattr(estimate.Priced, "lower_bound",
                        lambda self: real(self) * (3.0 if self.cand.pp == 1 else 1.0))
    monkeypatch.setattr(estimate.Priced, "predict", lambda self: estimate.Prediction(
        *estimate._simulated(self.cand, self.m, self.cost, self.comm, self.step), self.peak,
        self.flops_per_device, self.stage_layers))
    pruned = search(SPEC, mesh, 16, DEV, space=SMALL)
    assert [r.cand for r in pruned.ranked] != [r.cand for r in every.ranked]


@pytest.mark.parametrize("limit", [None, "median"])
def test_search_winner_is_the_full_plans_winner(limit):
    """Every candidate planned in full, at a limit that does not bind and at one
    that does: the search, its winner proven (`full.prove`: the first of its
    ranking whose full plan fits), picks the full plans' fastest (or a tie)."""
    mesh = Mesh(1, 4)
    st = Setting(mesh, 16, DEV)
    pricer = _Pricer(SPEC, SPEC.config().layers, st, 1 << 62)
    rows = []
    space = SMALL
    for cand in candidates(mesh, SPEC.config().layers, 16, space):
        counts, _ = pricer._works(cand, cand.recompute)
        rows.append((cand, evaluate(SPEC, cand, st, counts)))
    peaks = sorted(max(p.peak) for _, p in rows)
    cap = DEV.memory_bytes if limit is None else peaks[len(peaks) // 2]
    fits = [(c, p) for c, p in rows if max(p.peak) <= cap]
    best = min(p.step_s for _, p in fits)
    ranked = search(SPEC, mesh, 16, DEV, memory_limit=cap, space=space).ranked
    i, _ = prove(SPEC, ranked, st, cap)
    full = dict(rows)[ranked[i].cand]
    assert max(full.peak) <= cap
    # Where the limit binds, a candidate whose peak the search overestimates
    # (up to +60%) is dropped though it fits: a known gap (docs/concepts/auto.md),
    # held here to what it was measured at (15% on GPT tiny, 4 devices)
    assert full.step_s <= best * (1.001 if limit is None else 1.2)


def test_nothing_fits_says_the_smallest_peak():
    with pytest.raises(ConfigError, match=r"no strategy fits --memory-per-device 0\.00 GiB: "
                       r"the smallest planned peak found is .* allow at least"):
        search(SPEC, Mesh(1, 4), 16, DEV, memory_limit=1000, space=SMALL)


def test_a_mesh_the_model_cannot_use():
    # 7 devices: tp 7 splits no head of 4, pp 7 > 4 layers, dp 7 does not divide 16
    with pytest.raises(ConfigError,
                       match=r"no strategy for gpt tiny \(4 layers, 4 heads\) on 1 node"):
        search(SPEC, Mesh(1, 7), 16, DEV, space=SMALL)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "meshplan", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_unknown_device_model_is_one_line():
    r = _cli("plan", "--model", "gpt", "--size", "tiny", "--devices-per-node", "2",
             "--auto", "--device-model", "tpu-v9")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "tpu-v9" in r.stderr


def test_cli_plan_auto_json_and_compile_auto(tmp_path):
    r = _cli("plan", "--model", "gpt", "--size", "tiny", "--devices-per-node", "4",
             "--global-batch-size", "16", "--auto", "--device-model", "a100-80gb", "--json")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)
    assert len(t["top"]) == 10 and sum(1 for row in t["top"] if row.get("winner")) == 1
    steps = [row["step_s"] for row in t["top"]]
    assert steps == sorted(steps)
    win = next(row for row in t["top"] if row.get("winner"))
    r = _cli("compile", "--model", "gpt", "--size", "tiny", "--devices-per-node", "4",
             "--global-batch-size", "16", "--auto", "--device-model", "a100-80gb",
             "--out", str(tmp_path / "plans"), "--json", "--workers", "1")
    assert r.returncode == 0, r.stderr
    from meshplan.lowering.files import read_dir

    job, _ = read_dir(tmp_path / "plans")
    got = {k: getattr(job.strategy, k) for k in ("dp", "tp", "pp", "vpp", "zero")}
    assert got == {k: win[k] for k in got}


def test_cli_memory_limit_errors():
    r = _cli("plan", "--model", "gpt", "--size", "tiny", "--devices-per-node", "4",
             "--auto", "--device-model", "a100-80gb", "--memory-per-device", "12 parsecs")
    assert r.returncode == 2 and "not a size" in r.stderr
    r = _cli("plan", "--model", "gpt", "--size", "tiny", "--devices-per-node", "4",
             "--auto", "--device-model", "a100-80gb", "--memory-per-device", "1KB")
    assert r.returncode == 2 and "smallest planned peak" in r.stderr


@pytest.mark.slow
def test_cli_verify_auto_trains_like_eager():
    r = _cli("verify", "--model", "gpt", "--size", "tiny", "--devices-per-node", "4",
             "--global-batch-size", "16", "--auto", "--device-model", "a100-80gb",
             "--steps", "3", "--optimizer", "adamw", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] and "--auto chose" in r.stderr
