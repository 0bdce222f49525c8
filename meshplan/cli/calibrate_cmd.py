"""The `calibrate` verb: measure this machine and write the `cpu-local`
device model (`costmodel/load.py` reads it back); and `devices`, which lists
the device models or shows one with its sources.

What it measures, each with one thread, as one rank of `meshplan run` has:
matmul FLOP/s per dtype (float32, bfloat16, float16; the size grows while
one product stays short, so a slow 16-bit matmul is measured small), memory
bandwidth (a large copy: read + write bytes), what the rank executor spends
per task beyond its math (`kernel_overhead`: a train step of a GPT whose
kernels are tiny, over its task count), and gloo point-to-point and
all-reduce latency and bandwidth among local processes on 127.0.0.1 (N of
them with `--processes N`). The compute figures are one process's alone on
a core; `host_cores` (the machine's cores) tells the search that ranks on
this host share them (`search/estimate.py`: a step takes at least the
host's busy time over its cores), rather than folding the sharing into the
rates, which would slow a pipeline's ranks whose bubbles leave cores free.
The all-reduce fit gives `intra_bw` and `intra_latency` (for two ranks the
ring model is 2 a + S/B: `costmodel/device.py`), the point-to-point fit
`p2p_latency` and `p2p_bw` (pipeline transfers).

Invariants:
- Under a minute with the default sizes; every wait is bounded (the
  process group's timeout, a join with a deadline, then the processes are
  ended).
- The file is written atomically (`write_atomic`: a temp file, then a
  rename): a failed or interrupted run leaves the old file or none.
- A user mistake (an `--out` that is a directory or cannot be written) is
  one line, exit 2.
- `devices_per_node` = `os.cpu_count()` (nothing crosses nodes locally) and
  `inter_*` = `intra_*`; `memory_bytes` is the machine's memory shared out
  evenly over the cores.
- [Note: torch.distributed here] The style keeps `torch.distributed` in
  `runtime/`; this module imports it because the two measuring processes
  need only a bare process group, and runtime/ was off limits to the change
  that added this verb. Move `_gloo_worker` there when that is free.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from meshplan.costmodel.device import DTYPES, DeviceModel
from meshplan.costmodel.load import (
    LOCAL,
    device_model_json,
    known_device_models,
    load_device_model,
    local_model_path,
)
from meshplan.errors import ConfigError, RuntimeFault
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


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much each measurement does (the defaults: under a minute in all)."""

    matmul_max: int = 2048       # largest square matmul side
    matmul_s: float = 1.5        # seconds per dtype
    copy_bytes: int = 128 * 2**20
    copy_s: float = 1.0
    comm_bytes: int = 16 * 2**20  # the large gloo message
    comm_reps: int = 12
    latency_reps: int = 60
    timeout_s: float = 60.0      # bound on the two gloo processes


QUICK = Sizes(matmul_max=256, matmul_s=0.2, copy_bytes=8 * 2**20, copy_s=0.2,
              comm_bytes=2**20, comm_reps=4, latency_reps=10, timeout_s=60.0)


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


def calibrate(sizes: Sizes = Sizes(), processes: int = 2) -> tuple[DeviceModel, dict]:
    """Measure this machine (gloo among `processes` ranks): the `cpu-local`
    model and the raw figures."""
    rates, copy, overhead = _compute_figures(sizes)
    comm = gloo_figures(sizes, max(2, processes))
    cores = os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    flops = tuple((d, rates[d][0]) for d in DTYPES)
    model = DeviceModel(
        name=LOCAL, flops=flops, peak_flops=flops, mem_bw=copy,
        memory_bytes=int(memory // cores), devices_per_node=cores,
        intra_bw=comm["all_reduce_bw"], intra_latency=comm["all_reduce_latency"],
        inter_bw=comm["all_reduce_bw"], inter_latency=comm["all_reduce_latency"],
        p2p_latency=comm["p2p_latency"], p2p_bw=comm["p2p_bw"], kernel_overhead=overhead,
        host_cores=cores,
        sources=(f"measured by `meshplan calibrate` on {socket.gethostname()} at "
                 f"{datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}, "
                 f"torch {torch.__version__}, one thread per process",))
    measured = {"matmul_side": {d: rates[d][1] for d in DTYPES}, "copy_bytes": sizes.copy_bytes,
                "kernel_overhead": overhead,
                "comm_bytes": sizes.comm_bytes} | comm
    return model, measured


def _compute_figures(sizes: Sizes):
    """(matmul rate and side per dtype, copy bytes/s, per-task seconds), one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = {d: matmul_rate(getattr(torch, d), sizes) for d in DTYPES}
        return rates, copy_rate(sizes.copy_bytes, sizes.copy_s), task_overhead(sizes.copy_s)
    finally:
        torch.set_num_threads(threads)


def matmul_rate(dtype: torch.dtype, sizes: Sizes) -> tuple[float, int]:
    """(FLOP/s, side) of square matmuls in `dtype`: the side doubles from 64
    while one product takes under a tenth of the budget, then products of
    that side run for the rest of it."""
    deadline = time.perf_counter() + sizes.matmul_s
    n, took = 64, 0.0
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        t0 = time.perf_counter()
        torch.mm(a, b)
        took = time.perf_counter() - t0
        if took > sizes.matmul_s / 10 or 2 * n > sizes.matmul_max:
            break
        n *= 2
    times = [took]
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(times), n


def task_overhead(budget_s: float) -> float:
    """Seconds a rank's executor spends on a task beyond its math: a train
    step of a GPT whose kernels are tiny (2 layers, hidden 16, one sample of
    4 tokens), run by the executor every rank runs (`RankExecutor`), over
    its task count (the median of steps within `budget_s`)."""
    from meshplan.autodiff import OptimizerConfig, build_train_step
    from meshplan.capture import capture
    from meshplan.driver.executor import Executor
    from meshplan.models import build_model, example_batch, model_config

    cfg = model_config("gpt", "tiny", layers=2, hidden=16, heads=2, seq_len=4, vocab=16)
    module = build_model(cfg)
    batch = example_batch(cfg, 1)
    ex = Executor(build_train_step(capture(module, batch), OptimizerConfig("sgd", lr=0.0)))
    state = ex.init_state(module)
    ex.step(state, [batch])  # warm up
    deadline = time.perf_counter() + budget_s
    times: list[float] = []
    while not times or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        ex.step(state, [batch])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(ex.rank.plan.tasks)


def copy_rate(nbytes: int, budget_s: float) -> float:
    """Bytes/s of a large copy, counting the read and the write."""
    src = torch.ones(max(nbytes // 4, 1))
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once
    deadline = time.perf_counter() + budget_s
    times: list[float] = []
    while not times or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2.0 * src.nbytes / statistics.median(times)


def gloo_figures(sizes: Sizes, n: int = 2) -> dict:
    """Latency and bandwidth of gloo p2p (ranks 0 and 1) and all-reduce
    among `n` local processes, fitted from a 4-byte and a `comm_bytes`
    message (medians)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_gloo_worker, args=(r, n, port, sizes, results),
                         name=f"meshplan-calibrate-{r}") for r in range(n)]
    for p in procs:
        p.start()
    try:
        raw = results.get(timeout=sizes.timeout_s)
    except queue_mod.Empty:
        raise RuntimeFault(f"the gloo measurement among {n} local processes gave no result in "
                           f"{sizes.timeout_s:.0f} s; check that 127.0.0.1 accepts local "
                           "connections (a firewall, or GLOO_SOCKET_IFNAME)") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if "error" in raw:
        raise RuntimeFault(f"the gloo measurement failed: {raw['error']}; check that "
                           "127.0.0.1 accepts local connections")
    return fit(raw, sizes.comm_bytes, n)


def fit(raw: dict, nbytes: int, n: int = 2) -> dict:
    """Latency and bandwidth from the small and large medians. p2p: one way
    is half a round trip, latency the small message's, bandwidth the large
    one's bytes over its extra time. All-reduce of n ranks (ring): 2(n-1)
    steps of latency plus 2(n-1)/n S / B, so a = small / (2(n-1)) and
    B = 2(n-1)/n S / (large - small)."""
    p2p_lat = raw["p2p_small"] / 2
    steps = 2 * (n - 1)
    ar_lat = raw["all_reduce_small"] / steps
    p2p_extra = raw["p2p_large"] / 2 - p2p_lat
    ar_extra = raw["all_reduce_large"] - raw["all_reduce_small"]
    moved = steps / n * nbytes
    return {
        "p2p_latency": p2p_lat,
        "p2p_bw": nbytes / (p2p_extra if p2p_extra > 0 else raw["p2p_large"] / 2),
        "all_reduce_latency": ar_lat,
        "all_reduce_bw": moved / (ar_extra if ar_extra > 0 else raw["all_reduce_large"]),
        "processes": n,
        "raw_medians_s": raw,
    }


def _gloo_worker(rank: int, n: int, port: int, sizes: Sizes, results) -> None:
    """One of the `n` measuring processes; rank 0 reports the medians."""
    import torch.distributed as dist  # [Note: torch.distributed here]

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n,
                                timeout=datetime.timedelta(seconds=sizes.timeout_s))
        raw = {}
        for name, nbytes, reps in (("small", 4, sizes.latency_reps),
                                   ("large", sizes.comm_bytes, sizes.comm_reps)):
            t = torch.zeros(max(nbytes // 4, 1))
            raw[f"p2p_{name}"] = _median_time(reps, lambda t=t: _ping_pong(dist, rank, t)) \
                if rank < 2 else 0.0
            dist.barrier()
            raw[f"all_reduce_{name}"] = _median_time(reps, lambda t=t: dist.all_reduce(t))
        dist.barrier()
        if rank == 0:
            results.put(raw)
        dist.destroy_process_group()
    except Exception as e:  # reported by the parent as one line
        if rank == 0:
            results.put({"error": f"{type(e).__name__}: {e}".splitlines()[0]})


def _ping_pong(dist, rank: int, t: torch.Tensor) -> None:
    if rank == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    else:
        dist.recv(t, 0)
        dist.send(t, 0)


def _median_time(reps: int, f) -> float:
    f()  # warm up: connections, buffers
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
