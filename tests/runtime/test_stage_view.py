"""A rank reads only its stage's view of the Job (runtime/worker.py): its
process decodes the Job's head, the "graph" part, the transfers and its own
stage's ops and values, never another stage's, and never the whole Job; the
one exception is the rank that writes a checkpoint's manifest, which also
decodes every stage's values (not their ops). Its collective groups are the
ones of the whole Job that hold it, found from its view alone."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.run import run
from meshplan.ir import job as job_module
from meshplan.ir.fileio import Parts
from meshplan.ir.mesh import Mesh
from meshplan.models import model_config
from meshplan.runtime import launch
from meshplan.runtime.comm import job_groups, rank_groups

CFG = model_config("gpt", "tiny")
TIED = model_config("gpt", "tiny", tie_embeddings=True)


def _recording(monkeypatch, log):
    """Every part any process decodes (and every whole-Job decode), by pid,
    appended to `log`: the ranks are forked, so they inherit the patches."""
    load, whole = Parts.load, job_module.JobReader.job

    def recorded_load(self, name):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {name}\n")
        return load(self, name)

    def recorded_whole(self):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} WHOLE\n")
        return whole(self)

    monkeypatch.setattr(Parts, "load", recorded_load)
    monkeypatch.setattr(job_module.JobReader, "job", recorded_whole)
    monkeypatch.setattr(launch, "_context", lambda: mp.get_context("fork"))


def _parts_by_process(log) -> list[set[str]]:
    seen: dict[str, set[str]] = {}
    for line in open(log).read().splitlines():
        pid, name = line.split()
        seen.setdefault(pid, set()).add(name)
    return list(seen.values())


def _stage_of(parts: set[str]) -> int:
    (stage,) = {int(p.split("/")[1]) for p in parts if p.startswith("ops/")}
    return stage


def _pp2():
    return zoo_strategy("gpt", CFG, pp=2, global_batch_size=4, micro_batch_size=2)


@pytest.mark.slow
def test_each_rank_decodes_only_its_stage(tmp_path, monkeypatch):
    log = tmp_path / "parts.log"
    _recording(monkeypatch, log)
    run("gpt", "tiny", Mesh(1, 2), _pp2(), steps=2, timeout_s=120)
    ranks = _parts_by_process(log)
    assert len(ranks) == 2 and sorted(_stage_of(p) for p in ranks) == [0, 1]
    for parts in ranks:
        s = _stage_of(parts)
        assert parts <= {"head", "graph", "transfers", f"ops/{s}", f"values/{s}"}, parts
    # a checkpoint: its manifest's writer (rank 0) decodes every stage's values
    log.unlink()
    run("gpt", "tiny", Mesh(1, 2), _pp2(), steps=1, timeout_s=120,
        save_dir=str(tmp_path / "ckpt"))
    by_stage = {_stage_of(p): p for p in _parts_by_process(log)}
    assert "values/1" in by_stage[0] and "ops/1" not in by_stage[0]
    assert by_stage[1] <= {"head", "graph", "transfers", "ops/1", "values/1"}


@pytest.mark.parametrize("fields", [dict(pp=2), dict(dp=2, pp=2), dict(tp=2, pp=2, vpp=2,
                                                                      schedule="interleaved")])
def test_rank_groups_are_the_jobs_groups_that_hold_the_rank(fields):
    """The tied embedding's gradient line across stages, and every grid line,
    found from the rank's own view, in the whole Job's order."""
    s = zoo_strategy("gpt", TIED, global_batch_size=8, micro_batch_size=2, **fields)
    job = plan_model("gpt", "tiny", Mesh(1, s.dp * s.tp * s.pp), s, tie_embeddings=True).job
    every = job_groups(s, job.graph.ops)
    assert any(len({s.stage_of_rank(r) for r in g}) > 1 for g in every)  # a shared line
    for rank in range(job.mesh.world):
        view = job.view(s.stage_of_rank(rank))
        assert rank_groups(s, rank, view.ops) == [g for g in every if rank in g]
