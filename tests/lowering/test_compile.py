"""compile_job's plan cache: hits report the same statistics as misses, and a
damaged cache entry is lowered again instead of being copied into the output."""

from __future__ import annotations

import pytest

from meshplan.driver.compile import _plan_cache, compile_job
from meshplan.errors import ConfigError
from meshplan.lowering.files import plan_files, plan_name, read_dir
from tests.lowering.jobs import job_of, plans_of

NAME = "gpt_interleaved"  # 2 ranks


def test_cache_hits_and_a_damaged_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path / "cache"))
    job, plans = job_of(NAME), plans_of(NAME)
    first = compile_job(job, tmp_path / "a", workers=1)
    assert not any(v["cache_hit"] for v in first["ranks"].values())
    second = compile_job(job, tmp_path / "b", workers=1)
    for r, v in second["ranks"].items():
        assert v["cache_hit"] and not v["lowered"]
        for k in ("tasks", "buffers", "planned_peak_bytes"):
            assert v[k] == first["ranks"][r][k] is not None
        assert (tmp_path / "b" / plan_name(r)).read_bytes() == plan_files(plans[r], job)[0]
    assert read_dir(tmp_path / "b")[1] == plans

    entry = _plan_cache(job.digest()) / "class_1.plan"  # stage 1's (no fixed axes)
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    third = compile_job(job, tmp_path / "c", workers=1)
    assert third["ranks"][0]["cache_hit"] and not third["ranks"][1]["cache_hit"]
    assert read_dir(tmp_path / "c")[1] == plans  # the output is whole
    assert entry.read_bytes() == plan_files(plans[1], job)[2]  # and the entry repaired

    entry.write_bytes(plan_files(plans[0], job)[2])  # a whole body, of the wrong class
    fourth = compile_job(job, tmp_path / "d", workers=1)
    assert not fourth["ranks"][1]["cache_hit"]
    assert read_dir(tmp_path / "d")[1] == plans


def test_ranks_outside_the_world_are_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="outside 0..1"):
        compile_job(job_of(NAME), tmp_path, ranks=[0, 2], use_cache=False)


def test_workspace_is_inferred_once_per_signature_whatever_the_rank_count(tmp_path):
    """The master asks each distinct (kind, local signature) once and the
    Job carries the answers: no rank infers, and the count does not grow
    with the ranks (ResNet's convolutions at dp 2 and dp 8)."""
    from meshplan.driver.compile import compile_model
    from meshplan.driver.plan import zoo_strategy
    from meshplan.ir.mesh import Mesh
    from meshplan.models import model_config

    seen = []
    for dp in (2, 8):
        s = zoo_strategy("resnet", model_config("resnet", "tiny"), dp=dp,
                         global_batch_size=2 * dp, micro_batch_size=2)
        r = compile_model("resnet", "tiny", Mesh(1, dp), s, tmp_path / str(dp), workers=2,
                          use_cache=False)
        temp = r["inference"]["temp"]
        assert temp["master_calls"] == temp["signatures"] > 0
        assert temp["rank_calls"] == 0
        seen.append(temp["master_calls"])
    assert seen[0] == seen[1]
