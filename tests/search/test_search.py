"""The search: branch and bound returns what simulating everything does; its
winner is the full plans' winner; user mistakes are one line."""

import json
import subprocess
import sys
from dataclasses import replace
from functools import cache

import pytest

from meshplan.costmodel import load_device_model
from meshplan.errors import ConfigError
from meshplan.ir.mesh import Mesh
from meshplan.search.estimate import Setting, memory
from meshplan.search.full import evaluate
from meshplan.search.probe import ModelSpec
from meshplan.search.search import _Pricer, search
from meshplan.search.space import Space, candidates

SPEC = ModelSpec("gpt", "tiny")
DEV = load_device_model("a100-80gb")
SMALL = Space(schedules=("1f1b", "interleaved", "zbv"), recompute=("none", "full"),
              zero=(0, 1, 3), micro_batch_sizes=(1, 2))


def test_pruning_returns_the_exhaustive_ranking():
    mesh = Mesh(1, 4)
    pruned = search(SPEC, mesh, 16, DEV, space=SMALL, prove=False)
    every = search(SPEC, mesh, 16, DEV, space=SMALL, exhaustive=True, prove=False)
    assert [r.cand for r in pruned.ranked] == [r.cand for r in every.ranked]
    assert pruned.simulated < every.simulated


def test_a_planted_loose_bound_breaks_pruning(monkeypatch):
    """A 'bound' above the simulated step prunes the true best: caught."""
    from meshplan.search import estimate

    mesh = Mesh(1, 4)
    every = search(SPEC, mesh, 16, DEV, space=SMALL, exhaustive=True, prove=False)
    real = estimate.Priced.lower_bound
    monkeypatch.setattr(estimate.Priced, "lower_bound",
                        lambda self: real(self) * (3.0 if self.cand.pp == 1 else 1.0))
    monkeypatch.setattr(estimate.Priced, "predict", lambda self: estimate.Prediction(
        *estimate._simulated(self.cand, self.m, self.cost, self.comm, self.step), self.peak,
        self.flops_per_device, self.stage_layers))
    pruned = search(SPEC, mesh, 16, DEV, space=SMALL, prove=False)
    assert [r.cand for r in pruned.ranked] != [r.cand for r in every.ranked]


def test_sequence_parallel_candidates_are_bounded_by_their_twins():
    """A candidate with sequence parallelism is first bounded by its twin
    without (less what it could save): on GPT tiny on 4 devices the pruned
    search still returns the exhaustive ranking (above), sp candidates in it,
    probing fewer; a planted bound that forgets the savings (above the
    candidate's own) is caught when the candidate is priced."""
    from meshplan.search import estimate

    mesh, both = Mesh(1, 4), replace(SMALL, sps=(False, True))
    pruned = search(SPEC, mesh, 16, DEV, space=both, prove=False, top=200)
    every = search(SPEC, mesh, 16, DEV, space=both, exhaustive=True, prove=False, top=200)
    assert [r.cand for r in pruned.ranked] == [r.cand for r in every.ranked]
    assert any(r.cand.sp for r in every.ranked)
    best = search(SPEC, mesh, 16, DEV, space=both, prove=False)
    without = search(SPEC, mesh, 16, DEV, space=replace(SMALL, sps=(False,)), prove=False)
    assert best.probes < every.probes and best.probes == without.probes
    real = estimate.Priced.bounding

    def forgets(self, cand, works=None):
        got = real(self, cand, works)
        return replace(got, cost={k: 2 * x for k, x in got.cost.items()}) if works else got
    with pytest.MonkeyPatch.context() as m:
        m.setattr(estimate.Priced, "bounding", forgets)
        with pytest.raises(AssertionError):
            search(SPEC, mesh, 16, DEV, space=both, prove=False, top=200)


@cache
def _every_plan(spec: ModelSpec = SPEC, space: Space = SMALL) -> tuple:
    """Every candidate of `spec` on 4 devices in `space` (GPT tiny, SMALL),
    planned in full: ((candidate, full Prediction, floor per rank), ...)."""
    mesh = Mesh(1, 4)
    st = Setting(mesh, 16, DEV)
    pricer = _Pricer(spec, spec.config().layers, st, 1 << 62)
    rows = []
    for cand in candidates(mesh, spec.config().layers, 16, space):
        counts, works = pricer._works(cand, cand.recompute)
        rows.append((cand, evaluate(spec, cand, st, counts),
                     memory(cand, works, counts, st, part="floor")))
    return tuple(rows)


def _limits() -> dict:
    peaks = sorted(max(p.peak) for _, p, _ in _every_plan())
    return {"device": DEV.memory_bytes, "q25": peaks[len(peaks) // 4],
            "median": peaks[len(peaks) // 2]}


# few micro-batches in flight: the memory layout packs saved values by liveness
# there, so what a floor may count is tightest (one that counted the values an
# I leaves for its W went to 1.078 of a full plan here: seen to fail)
FEW = Space(schedules=("zbv", "zb1p", "1f1b"), recompute=("none",), zero=(0, 2, 3),
            micro_batch_sizes=(4, 8))


@pytest.mark.parametrize("space", [SMALL, FEW], ids=["small", "few-microbatches"])
def test_the_floor_is_below_every_full_plan(space):
    mesh = Mesh(1, 4)
    st = Setting(mesh, 16, DEV)
    pricer = _Pricer(SPEC, SPEC.config().layers, st, 1 << 62)
    rows = (_every_plan() if space is SMALL else
            [(c, evaluate(SPEC, c, st, counts), memory(c, works, counts, st, part="floor"))
             for c in candidates(mesh, SPEC.config().layers, 16, space)
             for counts, works in [pricer._works(c, c.recompute)]])
    for cand, full, floor in rows:
        assert all(f <= p for f, p in zip(floor, full.peak)), cand


@pytest.mark.parametrize("limit", ["device", "q25", "median"])
def test_search_winner_is_the_full_plans_winner(limit):
    """Every candidate planned in full, at a limit that does not bind and at
    ones that do: the search's proven winner is the full plans' fastest that
    fits (or a tie)."""
    cap = _limits()[limit]
    best = min(p.step_s for _, p, _ in _every_plan() if max(p.peak) <= cap)
    res = search(SPEC, Mesh(1, 4), 16, DEV, memory_limit=cap, space=SMALL)
    full = {c: p for c, p, _ in _every_plan()}[res.winner.cand]
    assert max(full.peak) <= cap and res.proven == full
    assert full.step_s <= best * 1.001


def test_past_the_proof_budget_only_estimated_fits_are_proven(monkeypatch):
    from meshplan.search import search as search_mod

    cap = _limits()["q25"]
    whole = search(SPEC, Mesh(1, 4), 16, DEV, memory_limit=cap, space=SMALL)
    assert whole.over_when_planned > 0  # faster candidates that may fit, planned: over
    monkeypatch.setattr(search_mod, "MAX_PROOFS", 0)
    capped = search(SPEC, Mesh(1, 4), 16, DEV, memory_limit=cap, space=SMALL)
    assert capped.unproven > 0 and max(capped.winner.pred.peak) <= cap
    assert capped.proven is not None and max(capped.proven.peak) <= cap


def test_pruning_by_the_estimate_loses_the_winner(monkeypatch):
    """Planted: candidates dropped when their *estimated* peak is over the
    limit (what the search did before its floor). At some binding limit one
    of them fits, and is faster than what the search then picks."""
    from meshplan.search import search as search_mod

    real = search_mod.memory
    monkeypatch.setattr(search_mod, "memory", lambda c, w, n, st, part="peak": real(
        c, w, n, st, "state" if part == "state" else "peak"))
    lost = []
    peaks = sorted({max(p.peak) for _, p, _ in _every_plan()})
    for cap in peaks[len(peaks) // 8::len(peaks) // 8][:7]:  # binding limits, low to high
        best = min(p.step_s for _, p, _ in _every_plan() if max(p.peak) <= cap)
        won = {c: p for c, p, _ in _every_plan()}[search(SPEC, Mesh(1, 4), 16, DEV,
                                                         memory_limit=cap,
                                                         space=SMALL).winner.cand]
        lost.append(won.step_s > best * 1.001)
    assert any(lost)


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


# ---- a mixture of experts: the search chooses ep too ----

MOE = ModelSpec("moe", "tiny")
MOE_SPACE = Space(schedules=("1f1b", "zbv"), recompute=("none", "full"), zero=(0, 1, 3),
                  micro_batch_sizes=(2,), experts=MOE.experts)


def _every_moe_plan() -> tuple:
    return _every_plan(MOE, MOE_SPACE)


def test_moe_candidates_try_each_ep_dividing_dp_and_the_experts():
    eps = {(c.dp, c.ep) for c, _, _ in _every_moe_plan()}
    assert eps == {(4, 1), (4, 2), (4, 4), (2, 1), (2, 2), (1, 1)}
    assert not {c.ep for c in candidates(Mesh(1, 4), 4, 16, SMALL)} - {1}  # no experts


def test_moe_floor_is_below_every_full_plan_and_the_winner_is_theirs():
    """With ep in the space: the floor stays under every full plan, and at
    a limit that binds the search's proven winner is the full plans'
    fastest that fits."""
    rows = _every_moe_plan()
    for cand, full, floor in rows:
        assert all(f <= p for f, p in zip(floor, full.peak)), cand
    peaks = sorted(max(p.peak) for _, p, _ in rows)
    for cap in (DEV.memory_bytes, peaks[len(peaks) // 4]):
        best = min(p.step_s for _, p, _ in rows if max(p.peak) <= cap)
        res = search(MOE, Mesh(1, 4), 16, DEV, memory_limit=cap, space=MOE_SPACE)
        full = {c: p for c, p, _ in rows}[res.winner.cand]
        assert max(full.peak) <= cap and res.proven == full
        assert full.step_s <= best * 1.001


@pytest.mark.slow
def test_mixtral_sized_moe_on_64_h100s_chooses_expert_parallel():
    """Issue 38's bar: a Mixtral-8x7B-sized MoE (bf16, AdamW) on 8 nodes of
    8 H100s: the winner has ep > 1 and its full plan fits 80 GB (the time,
    about 7 s here, is `benchmarks/moe.py`'s to measure)."""
    spec = ModelSpec("moe", "mixtral-8x7b", (), "adamw", "bf16")
    h100 = load_device_model("h100-80gb")
    res = search(spec, Mesh(8, 8), 8, h100)
    assert res.winner.cand.ep > 1
    assert res.proven is not None and max(res.proven.peak) <= h100.memory_bytes


# ---- context parallelism: searched when nothing fits without it ----

LONG = ModelSpec("gpt", "small", (("seq_len", 2048),))


def test_cp_candidates_split_the_sequence_into_2cp_chunks():
    seq_space = Space(seq=40, recompute=("none",), zero=(0,), micro_batch_sizes=(1,))
    got = {(c.dp, c.cp) for c in candidates(Mesh(1, 8), 4, 8, seq_space) if c.tp == c.pp == 1}
    assert got == {(8, 1), (4, 2), (2, 4)}  # cp 8: 16 chunks do not divide 40 tokens
    assert {c.cp for c in candidates(Mesh(1, 8), 4, 8, SMALL)} == {1}


def test_the_search_splits_the_sequence_only_when_nothing_fits_without():
    """GPT small at seq 2048 (under LONG_SEQ) on 4 single-device nodes (no
    tp): at the device's memory the winner has cp 1 (cp is not searched);
    at 240 MiB nothing without cp fits, and the winner has cp > 1, its full
    plan within the limit."""
    space = Space(recompute=("none",), schedules=("1f1b",))
    roomy = search(LONG, Mesh(4, 1), 4, DEV, space=space)
    assert roomy.winner.cand.cp == 1
    tight = 240 << 20
    with pytest.raises(ConfigError, match="no strategy fits"):
        search(LONG, Mesh(4, 1), 4, DEV, memory_limit=tight, space=replace(space, cps=(1,)))
    res = search(LONG, Mesh(4, 1), 4, DEV, memory_limit=tight, space=space)
    assert res.winner.cand.cp > 1
    assert res.proven is not None and max(res.proven.peak) <= tight


@pytest.mark.slow
def test_a_gpt_8b_at_seq_131072_on_64_h200s_splits_the_sequence():
    """Issue 37's bar: GPT 8B (8.2B parameters) at seq 131072 on 8 nodes of
    8 H200s, bf16, AdamW: the winner has cp > 1 and its full plan fits
    141 GB (the time is `benchmarks/long_context_search.py`'s to measure)."""
    spec = ModelSpec("gpt", "8b", (("seq_len", 131072),), "adamw", "bf16")
    h200 = load_device_model("h200-141gb")
    res = search(spec, Mesh(8, 8), 16, h200)
    assert res.winner.cand.cp > 1
    assert res.proven is not None and max(res.proven.peak) <= h200.memory_bytes


# ---- sequence parallelism: with tp > 1 where the model has a sequence ----

def test_the_search_chooses_sequence_parallelism_where_only_it_fits():
    """GPT small at seq 2048 on 2 devices of a node, batch 2: at 250 MiB a
    device, tp2 with its activations between blocks split by sequence
    (236 MiB estimated) fits and nothing without sequence parallelism does
    (tp2: 266, dp2: 422, pp2: 373); the winner has it, its full plan within
    the limit."""
    space = Space(recompute=("none",), schedules=("1f1b",), cps=(1,), zero=(0,),
                  sps=(False, True))
    tight = 250 << 20
    with pytest.raises(ConfigError, match="no strategy fits"):
        search(LONG, Mesh(1, 2), 2, DEV, memory_limit=tight, space=replace(space, sps=(False,)))
    res = search(LONG, Mesh(1, 2), 2, DEV, memory_limit=tight, space=space)
    assert res.winner.cand.sp and res.winner.cand.tp == 2
    assert "tp2 sp" in res.winner.cand.label()
    # as the sequence says (the default): a short one searched without it
    # first, then with it when nothing fits
    default = search(LONG, Mesh(1, 2), 2, DEV, memory_limit=tight, space=replace(space, sps=()))
    assert default.winner.cand == res.winner.cand
    roomy = search(LONG, Mesh(1, 2), 2, DEV, space=replace(space, sps=()))
    assert not any(r.cand.sp for r in roomy.ranked)
    assert res.proven is not None and max(res.proven.peak) <= tight
    # its probes were planned with it: the estimate is the full plan's peak
    assert max(res.winner.pred.peak) == pytest.approx(max(res.proven.peak), rel=0.02)
    assert res.strategy().sequence_parallel
    assert not any(c.sp for c in candidates(Mesh(1, 2), 4, 8, SMALL) if c.tp == 1)


def test_cli_sequence_parallel_with_auto_keeps_it():
    """`--sequence-parallel --auto`: every candidate has it (so tp > 1)."""
    r = _cli("plan", "--model", "gpt", "--size", "tiny", "--devices-per-node", "4",
             "--global-batch-size", "16", "--auto", "--sequence-parallel",
             "--device-model", "a100-80gb", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["top"]
    assert rows and all(row["sequence_parallel"] and row["tp"] > 1 for row in rows)
