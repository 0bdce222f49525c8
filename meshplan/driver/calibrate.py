"""Measure this machine as the `cpu-local` device model (`meshplan calibrate`).

What it measures, each with one thread, as one rank of `meshplan run` has:
matmul FLOP/s per dtype (float32, bfloat16, float16; the size grows while
one product stays short, so a slow 16-bit matmul is measured small), memory
bandwidth (a large copy: read + write bytes), what the rank executor spends
per task beyond its math (`kernel_overhead`: a train step of a GPT whose
kernels are tiny, over its task count), and gloo point-to-point and
all-reduce latency and bandwidth among local processes on 127.0.0.1
(`runtime/gloo_timing.py`). The compute figures are one process's alone on
a core; `host_cores` (the machine's cores) tells the search that ranks on
this host share them (`search/estimate.py`: a step takes at least the
host's busy time over its cores), rather than folding the sharing into the
rates, which would slow a pipeline's ranks whose bubbles leave cores free.
The all-reduce fit gives `intra_bw` and `intra_latency` (for two ranks the
ring model is 2 a + S/B: `costmodel/device.py`), the point-to-point fit
`p2p_latency` and `p2p_bw` (pipeline transfers).

Invariants:
- Under a minute with the default sizes (`Sizes`); every wait is bounded.
- `devices_per_node` = `os.cpu_count()` (nothing crosses nodes locally) and
  `inter_*` = `intra_*`; `memory_bytes` is the machine's memory shared out
  evenly over the cores.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch

from meshplan.autodiff import OptimizerConfig, build_train_step
from meshplan.capture import capture
from meshplan.costmodel.device import DTYPES, DeviceModel
from meshplan.costmodel.load import LOCAL
from meshplan.driver.executor import Executor
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime.gloo_timing import gloo_medians


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


def calibrate(sizes: Sizes = Sizes(), processes: int = 2) -> tuple[DeviceModel, dict]:
    """Measure this machine (gloo among `processes` ranks): the `cpu-local`
    model and the raw figures."""
    rates, copy, overhead = _compute_figures(sizes)
    n = max(2, processes)
    comm = fit(gloo_medians(n, sizes.comm_bytes, sizes.comm_reps, sizes.latency_reps,
                            sizes.timeout_s), sizes.comm_bytes, n)
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
