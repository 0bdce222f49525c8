"""A rank killed with SIGKILL mid-run: GPT small at dp2·tp2·pp2 under
`meshplan train`, killed at a random step between two checkpoints. The run
ends naming the rank; `--resume` continues from the newest complete
checkpoint with losses bit-identical to the uninterrupted run's; with
`--max-restarts` the run restarts itself and its metrics are the
uninterrupted run's."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from meshplan.cli.main import main
from meshplan.driver.metrics import read_metrics

JSON_DIR = Path(sysconfig.get_paths()["stdlib"]) / "json"
RUN = ["--size", "small", "--devices-per-node", "8", "--tp", "2", "--pp", "2", "--vpp", "1",
       "--global-batch-size", "8", "--micro-batch-size", "2", "--steps", "8",
       "--optimizer", "adamw", "--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps",
       "2", "--clip-grad-norm", "1.0", "--eval-every", "4", "--eval-batches", "1",
       "--sample-tokens", "0", "--no-tensorboard", "--checkpoint-every", "3", "--keep", "0"]
WAIT_S = 300


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kill")
    data = tmp / "data"
    assert main(["-q", "prepare-data", "--input", str(JSON_DIR / "*.py"), "--out",
                 str(data)]) == 0
    out = tmp / "whole"
    assert main(["-q", "train", "--data", str(data), "--out", str(out), *RUN]) == 0
    return data, out


def _ranks_of(pid: int) -> list[int]:
    """The rank processes of the driver `pid`: the children of its
    forkserver (runtime/launch.py starts ranks from one)."""
    parent, cmd = {}, {}
    for d in Path("/proc").iterdir():
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd[int(d.name)] = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
    servers = {p for p, pp in parent.items() if pp == pid and b"forkserver" in cmd[p]}
    return sorted(p for p, pp in parent.items() if pp in servers)


def _kill_one_rank_after(proc, out: Path, step: int, rng: random.Random) -> int:
    """Wait until the run's metrics have `step` (with checkpoint step_3
    complete), then SIGKILL one of its ranks; returns that pid."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the kill"
        if (out / "metrics.jsonl").is_file() and step in _losses(out) and \
                (out / "checkpoints" / "step_3" / "COMPLETE").is_file():
            ranks = _ranks_of(proc.pid)
            if len(ranks) == 8:
                victim = rng.choice(ranks)
                os.kill(victim, signal.SIGKILL)
                return victim
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"step {step} not reached in {WAIT_S} s")


@contextlib.contextmanager
def _running(proc):
    """`proc`, and nothing of it left running after the test, passed or not."""
    try:
        yield proc
    finally:
        for pid in _ranks_of(proc.pid) + [proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _start(data: Path, out: Path, *extra: str):
    return subprocess.Popen([sys.executable, "-m", "meshplan", "-q", "train", "--data",
                             str(data), "--out", str(out), *RUN, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(uninterrupted, tmp_path):
    data, whole = uninterrupted
    rng = random.Random()
    step = rng.choice([4, 5])  # between the checkpoints after steps 3 and 6
    out = tmp_path / "killed"
    with _running(_start(data, out)) as proc:
        _kill_one_rank_after(proc, out, step, rng)
        _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode != 0
    assert "died (signal 9)" in err and len(err.strip().splitlines()) == 1, err
    assert main(["-q", "train", "--data", str(data), "--out", str(out), *RUN,
                 "--resume"]) == 0
    rows = read_metrics(out)
    resumed_at = [r for r in rows if r["kind"] == "resume"][-1]["step"]
    assert resumed_at in (3, 6), (step, resumed_at)
    assert _losses(out) == _losses(whole), f"killed after step {step}"
    assert [r for r in rows if r["kind"] == "eval"] == \
        [r for r in read_metrics(whole) if r["kind"] == "eval"]


@pytest.mark.slow
def test_max_restarts_restarts_from_the_newest_checkpoint(uninterrupted, tmp_path):
    data, whole = uninterrupted
    rng = random.Random()
    step = rng.choice([4, 5])
    out = tmp_path / "restarted"
    with _running(_start(data, out, "--max-restarts", "1")) as proc:
        _kill_one_rank_after(proc, out, step, rng)
        _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    resumes = [r for r in read_metrics(out) if r["kind"] == "resume"]
    assert len(resumes) == 1 and "died (signal 9)" in resumes[0]["reason"], resumes
    assert resumes[0]["step"] in (3, 6), (step, resumes)
    assert _losses(out) == _losses(whole), f"killed after step {step}"
    weights = "model.safetensors"
    assert (out / weights).read_bytes() == (whole / weights).read_bytes()
