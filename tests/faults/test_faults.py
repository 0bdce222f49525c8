"""Faults: a killed compile worker, a rank killed while saving a checkpoint.
(A rank killed mid-run is tests/runtime/test_launch.py::
test_a_killed_rank_ends_the_job_naming_it.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshplan.driver.compile import _plan_cache, compile_job
from meshplan.driver.plan import zoo_strategy
from meshplan.driver.run import run
from meshplan.errors import PlanError, RuntimeFault
from meshplan.ir.mesh import Mesh
from meshplan.lowering.files import open_class, read_dir
from meshplan.lowering.stage_files import StageFiles
from meshplan.models import model_config
from meshplan.runtime import launch
from tests.bad_inputs.files import PLAN_FLAGS
from tests.faults.kill import CLI_KILLING_RANK_1, dying_plan_bytes, rank_entry_killing
from tests.lowering.jobs import job_of

NAME = "gpt_interleaved"  # 2 ranks, 2 stages
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_a_killed_compile_worker_is_named_and_leaves_nothing_partial(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path / "cache"))
    lower = StageFiles.files
    monkeypatch.setattr(StageFiles, "files", dying_plan_bytes(1))
    job = job_of(NAME)
    with pytest.raises(PlanError) as e:
        compile_job(job, tmp_path / "out", workers=2)
    msg = str(e.value)
    assert "died (signal 9) while lowering rank 1" in msg and "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # no out/, no staging
    cache = _plan_cache(job.digest())
    entries = sorted(cache.iterdir()) if cache.exists() else []
    for p in entries:  # whatever the workers cached is whole
        assert open_class(p.read_bytes(), str(p))["stage"] == int(p.name[6])

    monkeypatch.setattr(StageFiles, "files", lower)
    compile_job(job, tmp_path / "out", workers=2)  # compiling again is safe
    assert sorted(read_dir(tmp_path / "out")[1]) == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cli_names_the_killed_worker_rank(tmp_path):
    env = os.environ | {"MESHPLAN_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-c", CLI_KILLING_RANK_1, "compile", *PLAN_FLAGS,
                        "--workers", "2", "--out", str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=240, env=env, cwd=ROOT)
    lines = p.stderr.strip().splitlines()  # plain progress lines may come first
    errors = [x for x in lines if x.startswith("meshplan: error:")]
    assert p.returncode == 2 and errors == lines[-1:] and "Traceback" not in p.stderr, p.stderr
    assert "compile worker died (signal 9) while lowering rank 1" in lines[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # three local runs: ~15 s
@pytest.mark.timeout(300)
def test_a_checkpoint_cut_by_a_killed_rank_is_never_resumed(tmp_path, monkeypatch):
    s = zoo_strategy("gpt", model_config("gpt", "tiny"), tp=2, global_batch_size=8,
                     micro_batch_size=8)
    ckpt = str(tmp_path / "ckpt")
    run("gpt", "tiny", Mesh(1, 2), s, steps=1, save_dir=ckpt)  # a whole one first
    assert (tmp_path / "ckpt" / "COMPLETE").is_file()
    t0 = time.monotonic()
    with monkeypatch.context() as m, pytest.raises(RuntimeFault, match="rank 1 died"):
        m.setattr(launch, "spawn_entry", rank_entry_killing(1, in_save=True))
        run("gpt", "tiny", Mesh(1, 2), s, steps=2, save_dir=ckpt)
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "ckpt" / "COMPLETE").exists()  # the old marker went first
    with pytest.raises(RuntimeFault, match="is incomplete"):
        run("gpt", "tiny", Mesh(1, 2), s, steps=3, save_dir=ckpt, resume=True)
