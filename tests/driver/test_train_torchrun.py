"""`meshplan train` under torchrun, each process one rank: the run equals the
local launcher's bit for bit; with torchrun's `--max-restarts`, a worker
killed with SIGKILL between two checkpoints makes torchrun restart them
all, and they resume from the newest complete checkpoint by themselves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

from meshplan.cli.main import main
from meshplan.driver.metrics import read_metrics

JSON_DIR = Path(sysconfig.get_paths()["stdlib"]) / "json"
ROOT = Path(__file__).resolve().parents[2]
RUN = ["--size", "tiny", "--devices-per-node", "4", "--tp", "1", "--pp", "2", "--vpp", "1",
       "--global-batch-size", "8", "--micro-batch-size", "2", "--steps", "6",
       "--optimizer", "adamw", "--warmup-steps", "1", "--clip-grad-norm", "1.0",
       "--eval-every", "3", "--eval-batches", "1", "--sample-tokens", "0",
       "--no-tensorboard", "--checkpoint-every", "2", "--keep", "0", "--stall-timeout", "120"]
WAIT_S = 300


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out) if r["kind"] == "train"}


def _workers(agent: int) -> list[int]:
    """torchrun's worker processes (its children running meshplan)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent and b"meshplan" in cmd:
            found.append(int(d.name))
    return sorted(found)


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_from_the_newest_checkpoint(tmp_path):
    data = tmp_path / "data"
    assert main(["-q", "prepare-data", "--input", str(JSON_DIR / "*.py"), "--out",
                 str(data)]) == 0
    whole = tmp_path / "whole"
    assert main(["-q", "train", "--data", str(data), "--out", str(whole), *RUN]) == 0
    out = tmp_path / "torchrun"
    tmp = tmp_path / "tmp"  # the workers' temporary folder: a killed one leaves nothing there
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                             "4", "--max-restarts", "1", "-m", "meshplan", "-q", "train",
                             "--data", str(data), "--out", str(out), *RUN],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"TMPDIR": str(tmp)})
    try:
        deadline = time.monotonic() + WAIT_S
        killed = None
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").is_file() and 3 in _losses(out) and \
                    (out / "checkpoints" / "step_2" / "COMPLETE").is_file():
                workers = _workers(proc.pid)
                if len(workers) == 4:
                    killed = workers[1]
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
        assert killed is not None, "step 3 not reached, or the run ended first"
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        for pid in _workers(proc.pid) + [proc.pid]:  # nothing outlives a failed test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 0, err[-3000:]
    resumes = [r for r in read_metrics(out) if r["kind"] == "resume"]
    assert len(resumes) == 1 and "torchrun restart 1" in resumes[0]["reason"], resumes
    assert resumes[0]["step"] in (2, 4), resumes
    assert _losses(out) == _losses(whole)
    from safetensors.torch import load_file

    got, want = load_file(out / "model.safetensors"), load_file(whole / "model.safetensors")
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not (out / ".ranks").exists()
    assert not list(tmp.glob("meshplan-*")), sorted(tmp.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_planted_disagreement_stops_the_torchrun_job_before_step_0(tmp_path):
    """8 torchrun processes, dp2 tp2 pp2; rank 5 (stage 1) lowers a plan whose
    send to rank 1 is cut short: the distributed check names the two ranks
    and no step runs."""
    data = tmp_path / "data"
    assert main(["-q", "prepare-data", "--input", str(JSON_DIR / "*.py"), "--out",
                 str(data)]) == 0
    out = tmp_path / "out"
    run = list(RUN)
    run[run.index("--devices-per-node") + 1], run[run.index("--tp") + 1] = "8", "2"
    env = os.environ | {"PYTHONPATH": str(ROOT), "BAD_RANK": "5"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8",
                        str(ROOT / "tests" / "faults" / "disagree.py"), "-q", "train",
                        "--data", str(data), "--out", str(out), *run],
                       capture_output=True, text=True, timeout=WAIT_S, env=env, cwd=ROOT)
    text = p.stdout + p.stderr
    assert p.returncode != 0
    assert "rank 5 and this rank disagree on the pieces" in text or \
        "rank 1 and this rank disagree on the pieces" in text, text[-3000:]
    assert not _losses(out) if (out / "metrics.jsonl").is_file() else True  # no step ran
