"""`meshplan train --async-checkpoint`: the checkpoints saved in the
background are complete and resume bit for bit at the same layout; a rank
killed in the middle of an async save (after its shard is written, before
the others') fails the run naming that rank, leaves that step's checkpoint
without `COMPLETE`, and the previous one resumes bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from meshplan.cli.main import main
from meshplan.driver.metrics import read_metrics
from meshplan.runtime.checkpoint import COMPLETE, FAULT_KILL

JSON_DIR = Path(sysconfig.get_paths()["stdlib"]) / "json"
COMMON = ["--size", "tiny", "--global-batch-size", "8", "--micro-batch-size", "2",
          "--steps", "6", "--optimizer", "adamw", "--lr", "3e-3", "--lr-schedule", "cosine",
          "--warmup-steps", "2", "--min-lr", "0", "--clip-grad-norm", "1.0",
          "--eval-every", "0", "--sample-tokens", "0", "--no-tensorboard",
          "--devices-per-node", "4", "--tp", "1", "--pp", "2", "--vpp", "1"]
SAVES = ["--checkpoint-every", "2", "--keep", "0"]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")
            if r["kind"] == "train"}


def _train(data: Path, out: Path, *flags: str) -> None:
    assert main(["-q", "train", "--data", str(data), "--out", str(out), *COMMON, *flags]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Prepared data, and an uninterrupted 6-step dp2 pp2 run saving every 2
    steps in the background."""
    tmp = tmp_path_factory.mktemp("async")
    data = tmp / "data"
    assert main(["-q", "prepare-data", "--input", str(JSON_DIR / "*.py"), "--out",
                 str(data)]) == 0
    _train(data, tmp / "async", *SAVES, "--async-checkpoint")
    return data, tmp / "async"


@pytest.mark.slow
def test_async_checkpoints_are_complete_and_resume_bit_identical(runs, tmp_path):
    from safetensors.torch import load_file

    data, out = runs
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step_2", "step_4", "step_6"]
    assert all((out / "checkpoints" / s / COMPLETE).is_file() for s in steps)
    _train(data, tmp_path / "again", "--resume", str(out / "checkpoints" / "step_4"))
    whole, resumed = _losses(out), _losses(tmp_path / "again")
    assert sorted(resumed) == [5, 6]
    assert all(resumed[k] == whole[k] for k in resumed), (resumed, whole)
    _train(data, tmp_path / "sync", *SAVES)  # the same run, saving synchronously
    assert _losses(tmp_path / "sync") == whole
    mine, theirs = (load_file(str(d / "model.safetensors")) for d in (out, tmp_path / "sync"))
    assert mine.keys() == theirs.keys()
    assert all(mine[k].equal(theirs[k]) for k in mine)


@pytest.mark.slow
def test_a_rank_killed_during_an_async_save(runs, tmp_path):
    """Rank 1 dies right after writing its shard of step 4's checkpoint. The
    run is a separate process: the fault point is read from the rank's
    environment, and the launcher's fork server keeps the one it started
    with."""
    data, whole = runs
    out = tmp_path / "killed"
    env = dict(os.environ, **{FAULT_KILL: "4:1"})
    got = subprocess.run([sys.executable, "-m", "meshplan.cli.main", "-q", "train", "--data",
                          str(data), "--out", str(out), *COMMON, *SAVES, "--async-checkpoint"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 2, got.stderr
    err = [line for line in got.stderr.splitlines() if line.startswith("meshplan: error")]
    assert len(err) == 1 and "rank 1 exited with code 137" in err[0], got.stderr
    step4 = out / "checkpoints" / "step_4"
    assert (step4 / "__1_0.distcp").is_file() and not (step4 / COMPLETE).is_file()
    from meshplan.driver.train import complete_checkpoints

    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step_2"]
    _train(data, tmp_path / "resumed", "--resume", str(out))  # its newest complete one
    resumed, losses = _losses(tmp_path / "resumed"), _losses(whole)
    assert sorted(resumed) == [3, 4, 5, 6]
    assert all(resumed[k] == losses[k] for k in resumed), (resumed, losses)
