"""Ranks of a stage that differ only in their own ids are lowered once
(`plan.stage_files`, keyed by `lower.RankClasses`): every rank's file must
still equal lowering that rank alone, byte for byte."""

from __future__ import annotations

import pytest

from meshplan.lowering import lower as lowering
from meshplan.lowering.files import plan_from_bytes, plan_to_bytes
from meshplan.lowering.stage_files import StageFiles
from tests.lowering.jobs import job_of, plans_of

# name -> how many ranks are lowered (one per class)
SHARED = {"gpt_tied_dp4": 1, "resnet_dp4": 1, "gpt_pp1": 4, "gpt_uneven_dp2": 8,
          "gpt_uneven_tp4": 2, "gpt_2x4": 8}


def files_of(name: str) -> tuple[dict[int, bytes], int]:
    job = job_of(name)
    stages: dict[int, StageFiles] = {}
    out, lowered = {}, 0
    for r in range(job.mesh.world):
        st = job.strategy.stage_of_rank(r)
        stages.setdefault(st, StageFiles(job.view(st)))
        out[r], _, fresh = stages[st].plan_bytes(r)
        lowered += fresh
    return out, lowered


@pytest.mark.parametrize("name", sorted(SHARED))
def test_shared_bodies_equal_lowering_each_rank(name):
    files, lowered = files_of(name)
    plans = plans_of(name)
    for r, data in files.items():
        assert data == plan_to_bytes(plans[r]), f"rank {r}"
        assert plan_from_bytes(data) == plans[r]
    assert lowered == SHARED[name]


def test_a_class_key_blind_to_groups_is_caught(monkeypatch):
    """Planted bug: a key without the collectives' groups lets dp2*tp2 ranks
    share bodies whose groups differ; the byte comparison fails."""
    real = lowering.RankClasses.key

    def blind(self, rank):
        return real(self, rank)[1:] if not self.p2p else real(self, rank)

    monkeypatch.setattr(lowering.RankClasses, "key", blind)
    files, lowered = files_of("gpt_pp1")
    plans = plans_of("gpt_pp1")
    assert lowered == 1
    assert any(files[r] != plan_to_bytes(plans[r]) for r in files)


def test_a_class_key_blind_to_shapes_is_caught(monkeypatch):
    """Planted bug: without local shapes, the tp ranks holding 33 and 32
    vocab rows (one tp group, no dp) would share one body."""
    real = lowering.RankClasses.key
    monkeypatch.setattr(lowering.RankClasses, "key", lambda self, r: real(self, r)[:2])
    files, lowered = files_of("gpt_uneven_tp4")
    plans = plans_of("gpt_uneven_tp4")
    assert lowered == 1
    assert any(files[r] != plan_to_bytes(plans[r]) for r in files)
