"""compile: run the master once, then lower every rank in its own process.

Invariants:
- The master (capture, autodiff, planning passes) runs once and yields the
  Job's bytes; each worker process rebuilds the Job from those bytes and
  lowers only the ranks it is given. No process ever holds two ranks' plans
  at once or the whole cluster's physical graph.
- Rank plans are cached under (job digest, rank, meshplan version): a
  repeated compile checks and copies them (an unreadable entry is lowered
  again and replaced), and a killed worker leaves no partial entry
  (entries are written atomically).
- Statistics: seconds per pass and per rank, inference calls and cache hits,
  tasks and buffers per rank, the compiling processes' peak memory.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import resource
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import meshplan
from meshplan.capture.cache import cache_dir
from meshplan.errors import ConfigError, MeshplanError, PlanError
from meshplan.ir.fileio import write_atomic
from meshplan.ir.job import Job
from meshplan.ops.infer import InferStats
from meshplan.ops.temp import TempStats
from meshplan.plan.files import plan_from_bytes, plan_name, plan_to_bytes, write_job
from meshplan.plan.lower import lower
from meshplan.plan.rankplan import RankPlan

log = logging.getLogger("meshplan")


def _plan_cache(digest: str) -> Path:
    return cache_dir() / "plans" / f"{digest}-{meshplan.__version__}"


def _read_cached(path: Path, digest: str, rank: int) -> tuple[bytes, RankPlan] | None:
    """A cache entry's bytes and plan; None when it is absent, unreadable, or not
    `rank`'s plan of this Job (the caller then lowers afresh and replaces it).
    Checked, not copied blindly: a corrupt entry would otherwise reach every
    later compile, and "recompile it" would never cure it."""
    try:
        data = path.read_bytes()
        plan = plan_from_bytes(data, str(path))
    except (OSError, PlanError):
        return None
    if plan.rank != rank or plan.job_digest != digest:
        return None
    return data, plan


_WORKER_JOB: dict = {}


def _init_worker(job_bytes: bytes, digest: str) -> None:
    """Pool initializer: decode the Job once per worker process."""
    _WORKER_JOB["job"] = Job.from_bytes(job_bytes)
    _WORKER_JOB["digest"] = digest or _WORKER_JOB["job"].digest()


def lower_ranks(job_bytes: bytes | None, ranks: list[int], out: str, use_cache: bool,
                digest: str = "") -> dict:
    """Worker body: lower `ranks` of the Job in `job_bytes` (None: the Job
    this worker was started with), write their files."""
    if job_bytes is not None:
        _init_worker(job_bytes, digest)
    job, digest = _WORKER_JOB["job"], _WORKER_JOB["digest"]
    stats = {}
    for rank in ranks:
        t0 = time.perf_counter()
        cached = _plan_cache(digest) / plan_name(rank)
        entry = _read_cached(cached, digest, rank) if use_cache else None
        if entry is not None:
            (data, plan), hit = entry, True
        else:
            plan = lower(job, rank, job_digest=digest)
            data, hit = plan_to_bytes(plan), False
            if use_cache:
                cached.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(cached, data)
        tasks, buffers, peak = len(plan.tasks), len(plan.buffers), plan.memory.peak_bytes()
        write_atomic(Path(out) / plan_name(rank), data)
        stats[rank] = {"lower_s": time.perf_counter() - t0, "cache_hit": hit, "tasks": tasks,
                       "buffers": buffers, "planned_peak_bytes": peak}
    stats["_process"] = {"pid": os.getpid(), "temp": TempStats.snapshot(),
                         "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                         * 1024}
    return stats


def compile_job(job: Job, out: str | Path, ranks: list[int] | None = None,
                workers: int | None = None, use_cache: bool = True,
                progress=None) -> dict:
    """Write `out/job.json` and the plans of `ranks` (default: all), lowered by
    `workers` processes (default: the number of cores). `progress(done,
    total)` is called as ranks finish."""
    world = job.mesh.world
    ranks = list(range(world)) if ranks is None else ranks
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ConfigError(f"--ranks lists rank {bad[0]}, outside 0..{world - 1}")
    out = Path(out)
    write_job(out, job)
    workers = max(1, min(workers or os.cpu_count() or 1, len(ranks)))
    # Batches of ranks small enough for ~16 progress updates per worker; each
    # worker decodes the Job once (initializer), not once per batch.
    size = max(1, len(ranks) // (16 * workers))
    batches = [ranks[i:i + size] for i in range(0, len(ranks), size)]
    stats: dict = {}
    procs: dict = {}
    log.info("lowering %d ranks in %d worker processes (%d batches) into %s", len(ranks),
             workers, len(batches), out)
    ctx = mp.get_context("fork" if hasattr(os, "fork") else "spawn")
    # Forked workers share the master's heap copy-on-write; a garbage
    # collection in a worker would touch (and copy) all of it. Measured: 0.25 s
    # per ResNet-50 rank in a worker without this, 0.08 s with it.
    gc.freeze()
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(job.to_bytes(), job.digest())) as pool:
            futures = {pool.submit(lower_ranks, None, b, str(out), use_cache): b
                       for b in batches}
            for fut in as_completed(futures):
                result = _result(fut, futures[fut])
                proc = result.pop("_process")
                procs[proc["pid"]] = proc  # the latest: its counters are cumulative
                stats.update(result)
                if progress is not None:
                    progress(len(stats), len(ranks))
    finally:
        gc.unfreeze()
    return {"ranks": {r: stats[r] for r in sorted(stats)}, "workers": workers,
            "worker_maxrss_bytes": max((p["maxrss_bytes"] for p in procs.values()), default=0),
            "temp_inference": _sum_stats(p["temp"] for p in procs.values())}


def _result(fut, batch: list[int]) -> dict:
    try:
        return fut.result()
    except MeshplanError:
        raise
    except Exception as e:  # a worker died or raised
        raise PlanError(f"compile worker for ranks {batch[:8]} failed "
                        f"({type(e).__name__}: {e}); cache entries are whole or "
                        "absent, so compiling again is safe") from e


def _sum_stats(items) -> dict:
    out = {"calls": 0, "cache_hits": 0}
    for s in items:
        out["calls"] += s["calls"]
        out["cache_hits"] += s["cache_hits"]
    return out


def compile_model(model: str, size: str, mesh, strategy, out, optimizer: str = "sgd",
                  lr: float | None = None, ranks=None, workers=None, use_cache: bool = True,
                  progress=None, **overrides) -> dict:
    """The whole compile of a zoo model: master once, then ranks in workers."""
    from meshplan.driver.plan import plan_model

    planned = plan_model(model, size, mesh, strategy, optimizer, lr, **overrides)
    master_s = sum(planned.timings.values())
    stats = compile_job(planned.job, out, ranks, workers, use_cache, progress)
    return {"capture_s": planned.capture_s, "master_s": master_s,
            "passes_s": planned.timings, "job_digest": planned.job.digest(), **stats,
            "inference": {"logical": InferStats.snapshot(),
                          "temp": stats.pop("temp_inference")},
            "master_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
