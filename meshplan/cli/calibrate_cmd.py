"""The `calibrate` verb: measure this machine and write the `cpu-local`
device model (`driver/calibrate.py` measures, `costmodel/load.py` reads it
back); and `devices`, which lists the device models or shows one with its
sources.

Invariants:
- The file is written atomically (`write_atomic`: a temp file, then a
  rename): a failed or interrupted run leaves the old file or none.
- A user mistake (an `--out` that is a directory or cannot be written) is
  one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from meshplan.costmodel.device import DeviceModel
from meshplan.costmodel.load import (
    LOCAL,
    device_model_json,
    known_device_models,
    load_device_model,
    local_model_path,
)
from meshplan.driver.calibrate import QUICK, Sizes, calibrate
from meshplan.errors import ConfigError
from meshplan.ir.fileio import write_atomic

EPILOG = """examples:
  meshplan calibrate
  meshplan calibrate --out /tmp/cpu-local.json --json
  meshplan plan ... --device-model cpu-local      (uses what calibrate wrote)"""

EPILOG_DEVICES = """examples:
  meshplan devices
  meshplan devices a100-80gb
  meshplan devices cpu-local --json"""

DESCRIPTION = """Measure this machine in under a minute: matmul FLOP/s (float32, bfloat16,
float16), memory bandwidth (a large copy), and gloo point-to-point and
all-reduce latency and bandwidth between 2 local processes, each with one
thread. Writes the device model 'cpu-local' ($MESHPLAN_HOME/devices/cpu-local.json,
MESHPLAN_HOME defaulting to ~/.cache/meshplan) and prints what it measured."""


def add_calibrate_flags(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.add_argument("--out", default="", metavar="PATH",
                   help=f"file to write (default {local_model_path()})")
    p.add_argument("--quick", action="store_true",
                   help="small sizes: a rougher model in a few seconds (tests)")
    p.add_argument("--processes", type=int, default=2, metavar="N",
                   help="measure gloo among N processes (default 2; give the rank count "
                   "you will run here); the search counts the cores they share")


def cmd_calibrate(a: argparse.Namespace) -> int:
    out = Path(a.out) if a.out else local_model_path()
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file path, e.g. {out}/{LOCAL}.json")
    t0 = time.perf_counter()
    if a.processes < 1:
        raise ConfigError(f"--processes {a.processes} must be >= 1; give the number of ranks "
                          "you will run on this machine, e.g. 4")
    model, measured = calibrate(QUICK if a.quick else Sizes(), a.processes)
    measured["seconds"] = round(time.perf_counter() - t0, 2)
    if not a.out:
        out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, device_model_json(model, {"measured": measured}).encode())
    if a.json:
        print(json.dumps({"path": str(out), "model": json.loads(device_model_json(model)),
                          "measured": measured}))
    else:
        print(table(model, measured))
        print(f"wrote {out}")
    return 0


def table(model: DeviceModel, measured: dict) -> str:
    """What was measured, one line each."""
    lines = [f"{model.name}: measured in {measured.get('seconds', 0):.1f} s, one thread per "
             f"process; {model.devices_per_node} cores"]
    for dtype, rate in model.flops:
        side = measured["matmul_side"][dtype]
        lines.append(f"  matmul {dtype:<9} {rate / 1e9:9.2f} GFLOP/s   ({side}x{side})")
    lines.append(f"  memory copy      {model.mem_bw / 1e9:9.2f} GB/s      "
                 f"({measured['copy_bytes'] / 2**20:.0f} MiB, read + write)")
    lines.append(f"  per task         {model.kernel_overhead * 1e6:9.2f} us        "
                 "(a rank executor's task beyond its math: kernel_overhead)")
    mib = measured["comm_bytes"] / 2**20
    lines.append(f"  gloo p2p         {measured['p2p_bw'] / 1e9:9.3f} GB/s      latency "
                 f"{measured['p2p_latency'] * 1e6:.1f} us  ({mib:.0f} MiB, 2 processes; "
                 "p2p_bw, p2p_latency)")
    lines.append(f"  gloo all_reduce  {measured['all_reduce_bw'] / 1e9:9.3f} GB/s      latency "
                 f"{measured['all_reduce_latency'] * 1e6:.1f} us/step  (intra_bw, "
                 "intra_latency)")
    return "\n".join(lines)


def add_devices_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default="",
                   help="a device model to show (default: list them all)")


def cmd_devices(a: argparse.Namespace) -> int:
    """List the device models, or show one: its rates and its sources."""
    if not a.name:
        names = known_device_models()
        if a.json:
            print(json.dumps({"device_models": list(names)}))
        else:
            print("\n".join(names))
        return 0
    model = load_device_model(a.name)
    if a.json:
        print(device_model_json(model).strip())
        return 0
    gb = 1e9
    print(f"{model.name}: {model.memory_bytes / 2**30:.1f} GiB, {model.devices_per_node} "
          "devices per node")
    for dtype, rate in model.flops:
        print(f"  {dtype:<9} {rate / 1e12:8.2f} TFLOP/s achievable of "
              f"{model.peak_flops_for(dtype) / 1e12:.2f} peak")
    print(f"  memory    {model.mem_bw / gb:8.1f} GB/s")
    print(f"  intra-node {model.intra_bw / gb:7.1f} GB/s, {model.intra_latency * 1e6:.1f} us; "
          f"inter-node {model.inter_bw / gb:.1f} GB/s, {model.inter_latency * 1e6:.1f} us")
    if model.p2p_bw is not None or model.p2p_latency is not None:
        bw, lat = model.p2p_bw or model.intra_bw, model.p2p_latency
        print(f"  point-to-point {bw / gb:.1f} GB/s, "
              f"{(lat if lat is not None else model.intra_latency) * 1e6:.1f} us")
    if model.kernel_overhead:
        print(f"  per kernel {model.kernel_overhead * 1e6:.1f} us beyond its math")
    if model.host_cores:
        print(f"  {model.host_cores} cores shared by a node's ranks (host_cores)")
    for s in model.sources:
        print(f"  source: {s}")
    return 0
