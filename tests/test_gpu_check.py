"""benchmarks/gpu_check.py on a machine without CUDA: one line and exit 2;
its report from made-up parts; and (slow) a CPU dry run of two parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=os.environ | {"PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_exits_at_once_with_one_line():
    p = _run()
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device here" in lines[0] and "--cpu-dry-run" in lines[0]


def test_report_judges_the_targets(tmp_path):
    from gpu_report import write_report

    def speed(step_s, frac, **kw):
        return {"status": "ok", "seconds": 10, "result": {
            "ok": True, "step_s": step_s, "tokens": 16384, "params": 1.3e9, "tflops": 400.0,
            "fraction_of_peak": frac, "peak_tflops": 989.0, "judged": "ran",
            "config": {"layers": 24, "hidden": 2048, "heads": 16, "seq_len": 2048,
                       "vocab": 50304, "batch": 8}, **kw}}

    report = {"environment": {"date": "today", "gpu": "NVIDIA H200", "torch": "2.11",
                              "cuda": "13.0", "python": "3.12"}, "dry_run": False,
              "budget_s": 450, "total_s": 100, "parts": {
                  "verify_fp32": {"status": "ok", "seconds": 5, "result": {
                      "judged": "max |loss diff| <= 1e-4", "max_abs_diff": 1e-7}},
                  "speed_meshplan": speed(0.42, 0.36, planned_peak_bytes=2**36,
                                          measured_peak_bytes=2**35),
                  "speed_eager": speed(0.40, 0.38),
                  "verify_tp2": {"status": "timeout", "seconds": 100, "exit_code": -9,
                                 "result": {}, "log_tail": ["starting", "stuck"]}}}
    write_report(report, tmp_path)
    md = (tmp_path / "gpu.md").read_text()
    assert json.loads((tmp_path / "gpu.json").read_text())["parts"]["verify_tp2"]["status"] \
        == "timeout"
    assert "meshplan / eager step time: 1.050 (target <= 1.05: met)" in md
    assert "36.0% (target >= 45%: NOT met)" in md
    assert "measured / planned 0.50" in md
    assert "max \\|loss diff\\|" in md  # a pipe inside a cell does not split the table
    assert "### verify_tp2 (timeout, exit code -9)" in md and "stuck" in md


@pytest.mark.slow
def test_cpu_dry_run_of_two_parts(tmp_path):
    p = _run("--cpu-dry-run", "--only", "verify_fp32,speed_meshplan", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert [x["status"] for x in report["parts"].values()] == ["ok", "ok"]
    assert "| meshplan |" in (tmp_path / "gpu.md").read_text()
