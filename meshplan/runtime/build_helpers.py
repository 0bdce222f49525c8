"""Processes that build a rank's noted Inductor runs beside it, on the cores
its machine has spare (a cold cache's second step, `fused.build_noted`).

Invariants:
- A helper only speeds the builds up: it takes runs through the same file
  locks as the rank and never waits on one (`fused.build_task`), so each
  run is built once, by whoever takes it first. The rank's last pass waits
  on every run it left, and builds one a dead helper dropped: a helper that
  fails, or never starts, costs time and nothing else.
- A helper makes each run's graph as the rank does, from the run's ops and
  its inputs' templates: the same code, so the same artifact key (an FX
  graph's own pickle traces its code again, into other code). It builds with
  the rank's thread count, which a CPU artifact's code depends on.
- Helpers start in a different place of the run list each, and only where
  a machine has more cores than local ranks, for runs on a CPU: a CUDA
  build would open a device context in every helper (Inductor compiles a
  CUDA run's Triton kernels in a pool of its own).
- When the rank's last pass ends every run is built; its helpers are then
  ended, and nothing of them is left: no file, no process.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import torch

import meshplan


def count(device: torch.device, local_ranks: int, runs: int) -> int:
    """How many helpers a rank of `local_ranks` on this machine starts for
    `runs` runs to build: one a spare core, one a run beyond its own first."""
    if device.type != "cpu":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    return max(0, min(runs - 1, cores // max(1, local_ranks) - 1))


@contextlib.contextmanager
def beside(tasks: list, helpers: int):
    """`helpers` processes building `tasks` (`fused.build_task`'s) while the
    caller builds them too; ended on the way out. Yields the processes."""
    procs = [p for i in range(helpers)
             if (p := _start(tasks, (i + 1) * len(tasks) // (helpers + 1))) is not None]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _start(tasks: list, offset: int) -> subprocess.Popen | None:
    """A helper building `tasks` from `offset` on; None if none could start
    (the rank builds them all itself)."""
    root = str(Path(meshplan.__file__).resolve().parents[1])
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        p = subprocess.Popen([sys.executable, "-m", "meshplan.runtime.build_helpers"],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env)
    except OSError:  # no process to spare (a limit on processes, or memory)
        return None
    payload = pickle.dumps((torch.get_num_threads(), offset, tasks))
    # fed from a thread: the helper reads it after importing torch (seconds)
    threading.Thread(target=_feed, args=(p.stdin, payload), daemon=True).start()
    return p


def _feed(pipe, payload: bytes) -> None:
    with contextlib.suppress(OSError):  # the helper ended first (the rank was done)
        with pipe:
            pipe.write(payload)


def main() -> None:
    """A helper: build each task, from its offset round, leaving those
    another process is building."""
    from meshplan.runtime.fused import build_task  # reason: fused starts helpers

    threads, offset, tasks = pickle.loads(sys.stdin.buffer.read())
    torch.set_num_threads(threads)
    for task in tasks[offset:] + tasks[:offset]:
        build_task(task, wait=False)


if __name__ == "__main__":
    main()
