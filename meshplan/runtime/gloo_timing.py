"""Gloo's point-to-point and all-reduce times among local processes, for
`meshplan calibrate` (driver/calibrate.py fits a device model to them).

Invariants:
- Each measuring process is one rank on 127.0.0.1 with one thread, as a
  rank of `meshplan run` has; rank 0 reports the medians.
- Every wait is bounded: the process group's timeout, the result queue's,
  a join with a deadline, then the processes are ended. A failure is one
  `RuntimeFault` line.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue as queue_mod
import socket
import statistics
import time

import torch
import torch.distributed as dist

from meshplan.errors import RuntimeFault


def gloo_medians(n: int, comm_bytes: int, comm_reps: int, latency_reps: int,
                 timeout_s: float) -> dict:
    """Median seconds of gloo p2p round trips (ranks 0 and 1) and all-reduces
    among `n` local processes, for a 4-byte and a `comm_bytes` message:
    keys `p2p_small`, `p2p_large`, `all_reduce_small`, `all_reduce_large`."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    counts = (comm_bytes, comm_reps, latency_reps)
    procs = [ctx.Process(target=_gloo_worker, args=(r, n, port, counts, timeout_s, results),
                         name=f"meshplan-calibrate-{r}") for r in range(n)]
    for p in procs:
        p.start()
    try:
        raw = results.get(timeout=timeout_s)
    except queue_mod.Empty:
        raise RuntimeFault(f"the gloo measurement among {n} local processes gave no result in "
                           f"{timeout_s:.0f} s; check that 127.0.0.1 accepts local "
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
    return raw


def _gloo_worker(rank: int, n: int, port: int, counts: tuple[int, int, int], timeout_s: float,
                 results) -> None:
    """One of the `n` measuring processes; rank 0 reports the medians."""
    comm_bytes, comm_reps, latency_reps = counts
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n,
                                timeout=datetime.timedelta(seconds=timeout_s))
        raw = {}
        for name, nbytes, reps in (("small", 4, latency_reps),
                                   ("large", comm_bytes, comm_reps)):
            t = torch.zeros(max(nbytes // 4, 1))
            raw[f"p2p_{name}"] = _median_time(reps, lambda t=t: _ping_pong(rank, t)) \
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


def _ping_pong(rank: int, t: torch.Tensor) -> None:
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
