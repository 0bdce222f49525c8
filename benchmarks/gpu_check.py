"""One command that proves the GPU path on a machine with a CUDA device:

    PYTHONPATH=. python benchmarks/gpu_check.py

runs, each part in its own process under its own time limit, within a total
budget (default 450 s, under 8 minutes on one H200):

  verify_fp32      GPT tiny, 1 GPU, fp32, meshplan vs eager CUDA
  verify_bf16      GPT tiny, 1 GPU, bf16, vs eager autocast and eager fp32
  verify_cp2       GPT tiny seq 256, cp=2 on one GPU, two ranks, host-staged gloo
  verify_cp2_ring  the same with ring attention (--cp-attention ring)
  verify_moe_ep2   the zoo MoE tiny, dp=2 ep=2 on one GPU, two ranks, host-staged gloo
  verify_hf_moe_ep2  transformers' Mixtral tiny, dp=2 ep=2 (routed experts), the same way
  speed_meshplan   GPT ~1.3B (24 layers, hidden 2048, seq 2048, batch 8, bf16,
  speed_eager        AdamW, one GPU): step time, TFLOP/s, fraction of peak,
  speed_compile      planned vs measured peak memory; eager; torch.compile of
                     each block (regional compilation)
  speed_inductor   the same GPT, meshplan with --kernels inductor (issue 39)
  pytest_cuda      the tests marked `cuda` (pytest -m cuda)
  verify_pp2_vpp2  pp=2 vpp=2 on one GPU, two ranks, host-staged gloo
  verify_tp2       tp=2 on one GPU, two ranks, host-staged gloo
  dropout          counter-based random bits on the GPU equal the CPU's, and
                     GPT tiny dropout 0.1 tp=2 verifies (same masks as eager)
  speed_profile    one profiled step of meshplan and of eager: where time goes
  profile_inductor the same for meshplan --kernels inductor and torch.compile

and writes benchmarks/results/gpu.json and gpu.md after every part, so a run
cut short still leaves what it found. A part that fails, crashes or runs out
of time is recorded with the tail of its output; the others still run.
Without CUDA it exits at once with one line. `--cpu-dry-run` runs every part
on CPU with a small model (results to a temporary folder unless --out), to
test this script where there is no GPU. It installs nothing and needs only
torch (2.11 or later), pytest and meshplan's source tree.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # meshplan from this source tree, without PYTHONPATH too

from gpu_report import write_report  # noqa: E402  (this folder is on sys.path)

# (part, time limit in seconds on a GPU), in the order they run: most
# important first, so a short budget still answers the main questions.
PARTS = [
    ("verify_fp32", 90), ("verify_bf16", 90), ("verify_cp2", 100), ("verify_cp2_ring", 100),
    ("verify_moe_ep2", 100), ("verify_hf_moe_ep2", 100),
    ("speed_meshplan", 150), ("speed_eager", 90), ("speed_compile", 180),
    ("pytest_cuda", 150), ("speed_inductor", 240), ("verify_pp2_vpp2", 120),
    ("verify_tp2", 100), ("dropout", 100), ("speed_profile", 120),
    ("profile_inductor", 150),
]
MIN_PART_S = 20  # a part is not started with less budget left than this
_RUNNING: list = []  # the part process now running (its own process group)


def _stop(signum, _frame) -> None:
    """SIGTERM/SIGINT: end the running part and its rank processes too (they
    live in their own session, so they would outlive this process), then exit."""
    for proc in _RUNNING:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    print(f"[gpu_check] stopped by signal {signum}; the report holds the parts done",
          flush=True)
    raise SystemExit(128 + signum)


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env |= {"gpu": p.name, "gpus": torch.cuda.device_count(),
                "gpu_memory_gib": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}"}
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["commit"] = ""
    return env


def run_part(name: str, limit: float, a, scratch: Path) -> dict:
    """Run one part in its own process group; its result, status and log tail."""
    result = scratch / f"{name}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_parts.py"), name, "--device",
           a.device, "--result", str(result)]
    if a.dry:
        cmd.append("--dry")
    if a.peak_tflops:
        cmd += ["--peak-tflops", str(a.peak_tflops)]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                   os.environ.get("PYTHONPATH")])),
                        "PYTHONUNBUFFERED": "1"}
    print(f"[gpu_check] {name}: starting (limit {limit:.0f} s)", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _RUNNING[:] = [proc]
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip())
            print(f"  [{name}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=limit)
        status = None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the part and any rank processes it started
        code = proc.wait()
        status = "timeout"
    reader.join(timeout=5)
    _RUNNING.clear()
    seconds = time.monotonic() - t0
    data = {}
    if result.is_file():
        try:
            data = json.loads(result.read_text())
        except ValueError:
            data = {}
    if status is None:
        status = "ok" if code == 0 and data.get("ok") else ("crash" if code < 0 or not data
                                                             else "fail")
    print(f"[gpu_check] {name}: {status.upper()} in {seconds:.0f} s", flush=True)
    return {"status": status, "seconds": round(seconds, 1), "exit_code": code,
            "limit_s": limit, "result": data, "log_tail": lines[-40:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-dry-run", dest="dry", action="store_true",
                   help="run every part on CPU with a small model (tests this script)")
    p.add_argument("--out", default=None, help="folder for gpu.json and gpu.md (default "
                   "benchmarks/results; a temporary folder with --cpu-dry-run)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="total seconds for all parts (default 450)")
    p.add_argument("--only", default="", help="comma-separated parts to run (default all)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's bf16 dense peak (default: known for H100/H200/A100)")
    a = p.parse_args(argv)
    if not a.dry and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA "
              f"{torch.version.cuda or 'none'}); nothing to check. Run it on a GPU machine, or "
              "pass --cpu-dry-run to test the script on CPU.", file=sys.stderr)
        return 2
    a.device = "cpu" if a.dry else "cuda"
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    out = Path(a.out) if a.out else (Path(tempfile.mkdtemp(prefix="gpu-check-dry-")) if a.dry
                                     else ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    known = [n for n, _ in PARTS]
    only = [x for x in a.only.split(",") if x] or known
    skip = [x for x in a.skip.split(",") if x]
    bad = [x for x in only + skip if x not in known]
    if bad:
        print(f"gpu_check: unknown part(s) {bad}; parts are {', '.join(known)}", file=sys.stderr)
        return 2
    report = {"environment": environment(a.device), "dry_run": a.dry,
              "budget_s": a.budget_s, "parts": {}}
    print(f"[gpu_check] {report['environment']}", flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for name, limit in PARTS:
            if name not in only or name in skip:
                continue
            left = a.budget_s - (time.monotonic() - start)
            if left < MIN_PART_S:
                report["parts"][name] = {"status": "skipped", "seconds": 0,
                                         "why": f"budget spent ({left:.0f} s left)"}
                print(f"[gpu_check] {name}: SKIPPED, budget spent", flush=True)
            else:
                report["parts"][name] = run_part(name, min(limit, left), a, Path(scratch))
            report["total_s"] = round(time.monotonic() - start, 1)
            write_report(report, out)
    parts = report["parts"].values()
    ok = sum(1 for x in parts if x["status"] == "ok")
    print(f"[gpu_check] {ok}/{len(report['parts'])} parts ok in {report['total_s']:.0f} s; "
          f"wrote {out / 'gpu.json'} and {out / 'gpu.md'}", flush=True)
    return 0 if ok == len(report["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
