"""compile: run the master once, then lower every rank in its own process.

Invariants:
- The master (capture, autodiff, planning passes) runs once and yields the
  Job's bytes; each worker process checks those bytes (one hash), decodes
  only the stages of the ranks it is given, and lowers one rank per plan
  class (`lowering/stage_files.py`): a worker gets a contiguous run of
  ranks in stage order, so a class is lowered by one worker (two at a
  seam). It writes each class's body once and a head per rank. No process
  holds the whole cluster's physical graph.
- Class bodies are cached under (job digest, meshplan version, device
  type, class): a repeated compile checks and reuses them (an unreadable
  entry, or one of another class, is lowered again and replaced), and a
  killed worker leaves no partial entry (entries are written atomically).
- The output directory changes only when every rank succeeded: files are
  staged beside it and moved in at the end. A worker that dies is reported
  by the rank it was lowering (a shared progress slot per worker); a shared
  count of finished ranks per worker drives the progress bar rank by rank.
- Statistics: seconds per pass and per rank (split into view, lower,
  serialize and write), logical inference calls and cache hits, kernel
  workspace inferences (the master's, one per distinct signature, and the
  ranks', none), tasks and buffers per rank, the processes' peak memory.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing as mp
import os
import resource
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import meshplan
from meshplan import errors
from meshplan.autodiff import OptimizerConfig
from meshplan.capture.cache import cache_dir
from meshplan.driver.plan import plan_model
from meshplan.driver.results import CompileResult, LowerResult
from meshplan.errors import ConfigError, MeshplanError, PlanError
from meshplan.ir.fileio import write_atomic, write_staged
from meshplan.ir.gc_pause import paused_gc
from meshplan.ir.job import Job, JobReader
from meshplan.lowering.classes import fixed_axes
from meshplan.lowering.files import CLASS_DIR, JOB_FILE, class_name, plan_name, write_job
from meshplan.lowering.stage_files import StageFiles
from meshplan.ops.infer import InferStats
from meshplan.ops.temp import TempStats

log = logging.getLogger("meshplan")


def _plan_cache(digest: str, device: str = "cpu") -> Path:
    suffix = "" if device == "cpu" else f"-{device}"
    return cache_dir() / "plans" / f"{digest}-{meshplan.__version__}{suffix}"


def lower_ranks(job_bytes: bytes, ranks: list[int], out: str, use_cache: bool,
                fixed: tuple[int, ...], progress=None, slot: int = 0, done=None,
                device: str = "cpu") -> dict:
    """Worker body: lower `ranks` of the Job in `job_bytes`, write their files.
    The bytes are hashed once (the digest) and only the parts the ranks'
    stages read are decoded, once per stage. `progress[slot]` says which
    rank the worker is lowering (for a report if it dies), `done[slot]` how
    many it has finished. The ranks of a plan class (`fixed`: the Job's
    fixed axes, `classes.fixed_axes`) are lowered once (`StageFiles`).
    Seconds per rank are split into view (decoding the stage: a class's
    first rank only), lower (a class's first rank only: lowering, encoding
    and the check at a second member), serialize (its head) and write."""
    with paused_gc():  # collections were a third of a GPT-3 rank's path
        return _lower_ranks(job_bytes, ranks, out, use_cache, progress, slot, done, device,
                            fixed)


def _lower_ranks(job_bytes, ranks, out, use_cache, progress, slot, done, device,
                 fixed) -> dict:
    t0, temp_calls = time.perf_counter(), TempStats.calls
    reader = JobReader(job_bytes)
    open_s = time.perf_counter() - t0
    cache = _plan_cache(reader.digest, device) if use_cache else None
    stages: dict[int, StageFiles] = {}
    written: set[str] = set()
    (Path(out) / CLASS_DIR).mkdir(exist_ok=True)
    stats = {}
    for rank in ranks:
        if progress is not None:
            progress[slot] = rank
        t = time.perf_counter()
        stage = reader.strategy.stage_of_rank(rank)
        if stage not in stages:
            stages[stage] = StageFiles(reader.strategy, stage, reader.digest,
                                       partial(reader.view, stage), fixed, device, cache)
        files = stages[stage]
        head, klass, made = files.files(rank)
        t1 = time.perf_counter()
        if klass.digest not in written:
            write_atomic(Path(out) / class_name(klass.digest), klass.data)
            written.add(klass.digest)
        write_staged(Path(out) / plan_name(rank), head)  # published whole: `_publish`
        secs = files.seconds | {"write": time.perf_counter() - t1}
        stats[rank] = {"lower_s": time.perf_counter() - t, "cache_hit": klass.cached,
                       "lowered": made and not klass.cached, "parts_s": secs} | klass.summary
        if done is not None:
            done[slot] += 1
    stats["_process"] = {"maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                         * 1024, "temp_calls": TempStats.calls - temp_calls, "open_s": open_s}
    return stats


def _worker(job_bytes: bytes, ranks: list[int], stage: str, use_cache: bool,
            progress, slot: int, done, device: str, fixed: tuple[int, ...]) -> None:
    """A compile worker process: its statistics, or its error, go to a file
    in the staging directory (JSON, never pickle)."""
    try:
        stats = lower_ranks(job_bytes, ranks, stage, use_cache, fixed, progress, slot, done,
                            device)
        write_atomic(Path(stage) / f".stats_{slot}.json", json.dumps(stats).encode())
    except Exception as e:  # reported by the parent, by rank
        name = type(e).__name__ if isinstance(e, MeshplanError) else ""
        fail = {"class": name, "rank": progress[slot], "error": f"{type(e).__name__}: {e}"}
        write_atomic(Path(stage) / f".fail_{slot}.json", json.dumps(fail).encode())
        raise SystemExit(1) from None


def _failure(slot: int, code: int, stage: Path, progress) -> MeshplanError:
    """One line naming the rank a worker was lowering when it failed."""
    rank = progress[slot]
    report = stage / f".fail_{slot}.json"
    if code > 0 and report.is_file():
        fail = json.loads(report.read_text())
        if fail["class"]:  # a user-facing error raised while lowering: keep its class
            return getattr(errors, fail["class"], PlanError)(fail["error"].partition(": ")[2])
        return PlanError(f"compile worker failed lowering rank {fail['rank']} "
                         f"({fail['error'][:200]}); this is a meshplan bug, please report it")
    how = f"died (signal {-code})" if code < 0 else f"exited with code {code}"
    return PlanError(f"compile worker {how} while lowering rank {rank}; no plan was written "
                     "and the plan cache holds only whole entries, so compiling again is safe")


def _run_workers(batches: list[list[int]], job_bytes: bytes, stage: Path, use_cache: bool,
                 progress_cb, total: int, device: str, fixed: tuple[int, ...]) -> dict:
    ctx = mp.get_context("fork" if hasattr(os, "fork") else "spawn")
    progress = ctx.Array("i", [-1] * len(batches), lock=False)
    done = ctx.Array("i", [0] * len(batches), lock=False)
    procs = [ctx.Process(target=_worker, name=f"meshplan-compile-{i}",
                         args=(job_bytes, b, str(stage), use_cache, progress, i, done, device,
                               fixed))
             for i, b in enumerate(batches)]
    stats: dict = {}
    reported = 0
    try:
        for p in procs:
            p.start()
        waiting = set(range(len(procs)))
        while waiting:
            time.sleep(0.02)
            finished = sum(done)
            if progress_cb is not None and finished > reported:
                reported = finished
                progress_cb(finished, total)
            for i in sorted(waiting):
                code = procs[i].exitcode
                if code is None:
                    continue
                if code != 0:
                    raise _failure(i, code, stage, progress)
                waiting.discard(i)
                stats.update({int(k) if k != "_process" else f"_process{i}": v for k, v in
                              json.loads((stage / f".stats_{i}.json").read_text()).items()})
        if progress_cb is not None and sum(done) > reported:
            progress_cb(sum(done), total)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return stats


def _staging_dir(out: Path) -> Path:
    """A fresh directory beside `out` (same file system: renames are atomic)."""
    if out.exists() and not out.is_dir():
        raise PlanError(f"--out {out} is a file, not a directory; pass a directory path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    except OSError as e:
        raise PlanError(f"cannot write plans to {out}: {e.strerror or e}; check that its "
                        "parent directory exists and is writable") from e


def _publish(stage: Path, out: Path) -> None:
    """Move the staged files into `out`: class bodies, then heads, job.json
    last. The files are synced to disk once, here, not one by one."""
    try:
        os.sync()
        out.mkdir(exist_ok=True)
        (out / CLASS_DIR).mkdir(exist_ok=True)
        for name in os.listdir(stage / CLASS_DIR):
            os.replace(stage / CLASS_DIR / name, out / CLASS_DIR / name)
        names = sorted(n for n in os.listdir(stage) if not n.startswith(".") and n != CLASS_DIR)
        for name in sorted(names, key=lambda n: n == JOB_FILE):
            os.replace(stage / name, out / name)
    except OSError as e:
        raise PlanError(f"cannot write plans to {out}: {e.strerror or e}; check that it is "
                        "a writable directory") from e


def compile_job(job: Job, out: str | Path, ranks: list[int] | None = None,
                workers: int | None = None, use_cache: bool = True,
                progress=None, device: str = "cpu") -> LowerResult:
    """Write `out/job.json` and the plans of `ranks` (default: all) for
    `device` (cpu | cuda: the device type picks each task's kernel), lowered by
    `workers` processes (default: the number of cores). Files are staged in a
    directory beside `out` and moved in only when every rank succeeded: a
    failed compile leaves `out` as it was (not even created)."""
    world = job.mesh.world
    ranks = list(range(world)) if ranks is None else ranks
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ConfigError(f"--ranks lists rank {bad[0]}, outside 0..{world - 1}; list ranks "
                          f"of the world only, e.g. 0-{world - 1}")
    out = Path(out)
    stage = _staging_dir(out)
    workers = max(1, min(workers or os.cpu_count() or 1, len(ranks)))
    # contiguous runs of stage order: a class is lowered by one worker (two at a seam)
    order = sorted(ranks, key=lambda r: (job.strategy.stage_of_rank(r), r))
    batches = [b for b in (order[len(order) * i // workers:len(order) * (i + 1) // workers]
                           for i in range(workers)) if b]
    log.info("lowering %d ranks in %d worker processes into %s", len(ranks), workers, out)
    # Forked workers share the master's heap copy-on-write; a garbage
    # collection in a worker would touch (and copy) all of it. Measured: 0.25 s
    # per ResNet-50 rank in a worker without this, 0.08 s with it.
    gc.freeze()
    try:
        write_job(stage, job)
        stats = _run_workers(batches, job.to_bytes(), stage, use_cache, progress, len(ranks),
                             device, fixed_axes(job))
        _publish(stage, out)
    finally:
        gc.unfreeze()
        shutil.rmtree(stage, ignore_errors=True)
    procs = [stats.pop(k) for k in [k for k in stats if not isinstance(k, int)]]
    return LowerResult(ranks={r: stats[r] for r in sorted(stats)}, workers=workers,
                       worker_maxrss_bytes=max((p["maxrss_bytes"] for p in procs), default=0),
                       open_s=max((p["open_s"] for p in procs), default=0.0),
                       temp_signatures=len(job.temps),
                       temp_rank_calls=sum(p["temp_calls"] for p in procs))


def compile_model(model: str, size: str, mesh, strategy, out,
                  optimizer: str | OptimizerConfig = "sgd",
                  lr: float | None = None, ranks=None, workers=None, use_cache: bool = True,
                  progress=None, device: str = "cpu", **overrides) -> CompileResult:
    """The whole compile of a zoo model: master once, then ranks in workers."""
    temp_calls = TempStats.calls
    planned = plan_model(model, size, mesh, strategy, optimizer, lr, **overrides)
    master_s = sum(planned.timings.values())  # autodiff, passes, Job bytes and digest
    temp_calls = TempStats.calls - temp_calls
    lowering = compile_job(planned.job, out, ranks, workers, use_cache, progress, device)
    return CompileResult(
        capture_s=planned.capture_s, master_s=master_s, passes_s=planned.timings,
        job_digest=planned.job.digest(), lowering=lowering,
        logical_inference=InferStats.snapshot(), master_temp_calls=temp_calls,
        master_maxrss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
