"""Local launch: one process per rank on 127.0.0.1, gloo, and a watchdog.

Invariants:
- Rank processes come from a fork server that imported torch once and never
  ran a kernel, so they start fast and clean.
- If a rank exits non-zero (it raised, or was killed), every other rank is
  ended within seconds, and the launch fails with one line naming the rank
  and the action it was in.
- No overall deadline: a run takes as long as its steps. A heartbeat bounds
  it instead. Each rank stamps `time.monotonic()` (one clock for every
  process of the machine) at each action it starts (progress), and a thread
  of it stamps every half second while the process runs (liveness). The run
  ends, naming one rank and its action, when no rank has progressed for
  `spec.stall_s`, or a rank has been frozen that long (no liveness: stopped,
  swapped out, its host hung). The rank named is the frozen one, else the
  one whose progress is oldest (a rank hung inside a kernel, whose peers
  then wait on it; in a deadlock every rank waits, and the oldest is named).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import time
from pathlib import Path

from meshplan.errors import KernelFault, RuntimeFault, TrainingHalted
from meshplan.ir.fileio import write_atomic
from meshplan.ir.job import JobReader
from meshplan.runtime.own_plan import rank_plan
from meshplan.runtime.rank_result import read_results
from meshplan.runtime.worker import RunSpec, spawn_entry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["meshplan.runtime.worker", "meshplan.runtime.rank_executor"])
    return ctx


def launch_local(spec: RunSpec, world: int, job_bytes: bytes,
                 on_step=None) -> dict[int, dict]:
    """Run `world` ranks locally; returns each rank's result.
    `on_step(k)` is called whenever every rank has finished k steps."""
    results = Path(spec.results)
    results.mkdir(parents=True, exist_ok=True)
    job_path = results / "job.bin"
    write_atomic(job_path, job_bytes)
    port = free_port()
    ctx = _context()
    progress = ctx.Array("i", [-1] * world, lock=False)
    steps_done = ctx.Array("i", [0] * world, lock=False)
    beats = ctx.Array("d", [time.monotonic()] * (2 * world), lock=False)  # progress, liveness
    procs = [ctx.Process(target=spawn_entry,
                         args=(spec.to_json(), r, world, str(job_path), port, progress,
                               steps_done, beats),
                         name=f"meshplan-rank-{r}") for r in range(world)]
    for p in procs:
        p.start()
    # the stall clock starts when the ranks exist: a fork server's first start
    # (its import of torch, seconds on a cold machine) is not a rank's stall
    beats[:] = [time.monotonic()] * (2 * world)
    try:
        _watch(procs, results, spec.stall_s, progress, job_bytes,
               _step_reporter(steps_done, on_step), beats)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return read_results(results, world)


def _step_reporter(steps_done, on_step):
    """A poll function calling `on_step(k)` each time the slowest rank's
    finished-step count k grows."""
    seen = [0]

    def poll() -> None:
        k = min(steps_done)
        if on_step is not None and k > seen[0]:
            seen[0] = k
            on_step(k)

    return poll


def _watch(procs, results: Path, stall_s: float, progress, job_bytes,
           poll=lambda: None, beats=None) -> None:
    while any(p.is_alive() for p in procs):
        time.sleep(0.05)
        poll()
        _raise_if_failed(procs, results, progress, job_bytes)
        if beats is not None:
            _raise_if_stalled(procs, beats, stall_s, progress, job_bytes)
    for p in procs:  # all ended: possibly all failed between two polls
        p.join(timeout=5)
    _raise_if_failed(procs, results, progress, job_bytes)
    poll()


def _raise_if_failed(procs, results: Path, progress, job_bytes) -> None:
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if bad:
        for p in procs:
            if p.is_alive():
                p.kill()
        message, first = _failure(bad, results, progress, job_bytes)
        error = first.get("error", "") if first else ""
        if error.startswith("TrainingHalted: "):  # the guard stopped every rank alike
            raise TrainingHalted(error.removeprefix("TrainingHalted: "))
        fault = KernelFault(message, first.get("exit_code", 1)) if \
            error.startswith("KernelFault: ") else RuntimeFault(message)
        if first and first.get("traceback"):  # shown under --debug, after the launcher's own
            fault.add_note(f"rank {first['rank']}'s traceback:\n{first['traceback']}")
        raise fault


def _raise_if_stalled(procs, beats, stall_s: float, progress, job_bytes) -> None:
    """End the run when no rank has progressed for `stall_s`, or one has been
    frozen that long (`beats`: progress times, then liveness times)."""
    now, world = time.monotonic(), len(procs)
    live = [r for r, p in enumerate(procs) if p.is_alive()]
    if not live:
        return
    frozen = [r for r in live if now - beats[world + r] > min(stall_s, 5.0)]
    if now - max(beats[r] for r in live) <= stall_s and \
            not any(now - beats[world + r] > stall_s for r in frozen):
        return
    r = max(frozen, key=lambda k: now - beats[world + k]) if frozen else \
        min(live, key=lambda k: beats[k])
    for p in procs:
        if p.is_alive():
            p.kill()
    raise RuntimeFault(f"rank {r} made no progress for {now - beats[r]:.0f} s (--stall-timeout "
                       f"{stall_s:g}{'; its process is frozen' if frozen else ''}) in action "
                       f"{_action_of(r, progress, job_bytes)}; the run was stopped. Look at that "
                       "rank's host, or raise --stall-timeout if its steps are that slow")


def _action_of(rank: int, progress, job_bytes: bytes) -> str:
    """The action a rank was in when it died (its plan, lowered here)."""
    index = progress[rank]
    if index < 0:
        return "setup"
    reader = JobReader(job_bytes, "the Job")
    view = reader.view(reader.strategy.stage_of_rank(rank))
    return str(rank_plan(view, rank).actions[index])


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _failure(bad: list[tuple[int, int]], results: Path, progress,
             job_bytes: bytes) -> tuple[str, dict | None]:
    """One line naming the rank that failed first: one killed by a signal,
    else one that exited without a report (killed: the OOM killer's 137,
    `os._exit`), for its peers then fail on broken connections; else the
    first report (returned too) of a rank's own error, before any report of
    a lost connection to a peer."""
    signalled = [(r, code) for r, code in bad if code < 0]
    if signalled:
        r, code = signalled[0]
        return (f"rank {r} died (signal {-code}) in action {_action_of(r, progress, job_bytes)};"
                " the other ranks were stopped"), None
    # every report, of a rank still exiting too (its peers' broken connections
    # may end them first); a rank's own error before a peer's lost connection
    reports = [json.loads(f.read_text()) for f in sorted(results.glob("fail_*.json"))]
    unreported = [(r, code) for r, code in bad if not (results / f"fail_{r}.json").is_file()]
    if reports and not unreported:
        own = [x for x in reports if not any(s in x.get("error", "") for s in _PEER_LOST)]
        first = min(own or reports, key=lambda x: x.get("time", 0))
        return (f"rank {first['rank']} failed in action {first['action']}: {first['error']}; "
                f"the other ranks were stopped"), first
    r, code = unreported[0]
    return (f"rank {r} exited with code {code} without a report; the other ranks were "
            "stopped"), None
