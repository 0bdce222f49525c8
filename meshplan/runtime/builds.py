"""The second step's builds (`--kernels inductor`): every run variant the
first step noted (`fused.InductorRun._rehearse`) built into this machine's
cache, by the rank and by helper processes on the cores its machine has
spare, before the step loads them.

Invariants:
- Every process builds through the same file lock per run
  (`kernel_cache.build_ahead`): a run is built once, by whoever takes it
  first. A rank first builds the runs no other process is building, then
  waits on the rest: members of a rank class, noting equal runs in the same
  order, so share the builds out, and each rank builds at once, not when a
  peer's output reaches it.
- A helper only speeds the builds up: it never waits on a lock, and the
  rank's last pass waits on every run it left, and builds one a dead helper
  dropped. A helper that fails, or never starts, costs time and nothing else.
  It imports the modules that register the runs' custom ops first, as the
  rank did (`ops.resolve.modules_of`): a run it could not trace would be
  kept as refused, for every process.
- A helper makes each run's graph as the rank does, from the run's ops and
  its inputs' templates (`task_graph`), so under the same artifact key (an FX
  graph's own pickle traces its code again, into other code), and builds
  with the rank's thread count, which a CPU artifact's code depends on. Its
  runs reach it as JSON on its stdin (nothing is unpickled).
- Helpers start at different places of the run list, only where a machine
  has more cores than local ranks, and for runs on a CPU: a CUDA build would
  open a device context in every helper (Inductor compiles a CUDA run's
  Triton kernels in a worker pool of its own).
- When the rank's last pass ends every run is built; its helpers are then
  ended, and nothing of them is left: no file, no process.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx

import meshplan
from meshplan.ir.serialize import op_from_row, op_to_row
from meshplan.ops.resolve import modules_of
from meshplan.runtime.fused import InductorRun, graph_of, specialized
from meshplan.runtime.kernel_cache import build_ahead, example, is_built


def build_noted(runs: list[InductorRun], on_each: Callable[[], None] | None = None,
                local_ranks: int = 1) -> None:
    """Build every variant the runs' first step noted (loading none: each
    run's next first call does), and forget them; `on_each` is told of each
    build (a watchdog's progress), `local_ranks` is this machine's count."""
    tasks = [(run, task) for run in runs for task in run.noted_tasks()]
    for run in runs:
        run.noted.clear()
    tasks = [(run, task) for run, task in tasks if not is_built(*task_graph(task))]
    helpers = helper_count(runs[0].device, local_ranks, len(tasks)) if tasks else 0
    with beside([task for _, task in tasks], helpers):
        later = [(run, task) for run, task in tasks
                 if not _timed(run, on_each, build_task, task, wait=False)]
        for run, task in later:
            _timed(run, on_each, build_task, task, wait=True)


def task_graph(task: tuple) -> tuple[fx.GraphModule, list, torch.device]:
    """A noted variant, `(ops, ins, outs, input templates, device)`, as the
    graph it is built as, inputs like its own, and its device: made from
    the same facts the same way in every process, so under the same key."""
    ops, ins, outs, templates, device = task
    args = [example(t) for t in templates]
    return specialized(graph_of(ops, ins, outs, device), args), args, device


def build_task(task: tuple, wait: bool) -> bool:
    """`kernel_cache.build_ahead` of a noted variant (`task_graph`)."""
    return build_ahead(*task_graph(task), wait=wait)


def _timed(run: InductorRun, on_each, fn: Callable, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    run.compile_s += time.perf_counter() - t0
    if on_each is not None:
        on_each()
    return out


def helper_count(device: torch.device, local_ranks: int, runs: int) -> int:
    """How many helpers a rank of `local_ranks` on this machine starts for
    `runs` runs to build: one a spare core, one a run beyond its own first."""
    if device.type != "cpu":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    return max(0, min(runs - 1, cores // max(1, local_ranks) - 1))


@contextlib.contextmanager
def beside(tasks: list, helpers: int):
    """`helpers` processes building `tasks` while the caller builds them
    too; ended on the way out. Yields the processes."""
    payload = _tasks_to_json(tasks) if helpers else None
    procs = [] if payload is None else [
        p for i in range(helpers)
        if (p := _start(payload, (i + 1) * len(tasks) // (helpers + 1))) is not None]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _start(payload: bytes, offset: int) -> subprocess.Popen | None:
    """A helper building the tasks `payload` holds from `offset` on; None if
    none could start (the rank builds them all itself)."""
    root = str(Path(meshplan.__file__).resolve().parents[1])
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        p = subprocess.Popen([sys.executable, "-m", "meshplan.runtime.builds",
                              str(torch.get_num_threads()), str(offset)],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env)
    except OSError:  # no process to spare (a limit on processes, or memory)
        return None
    # fed from a thread: the helper reads it after importing torch (seconds)
    threading.Thread(target=_feed, args=(p.stdin, payload), daemon=True).start()
    return p


def _feed(pipe, payload: bytes) -> None:
    with contextlib.suppress(OSError):  # the helper ended first (the rank was done)
        with pipe:
            pipe.write(payload)


def _tasks_to_json(tasks: list) -> bytes | None:
    """`tasks` as JSON, with the modules their ops need imported (custom
    ops); None if a template holds what JSON cannot (an input's Python
    attribute of another type: no helper then)."""
    try:
        return json.dumps({
            "modules": modules_of([op for ops, *_ in tasks for op in ops]),
            "tasks": [{"ops": [op_to_row(op) for op in ops], "ins": list(ins),
                       "outs": list(outs), "device": str(device),
                       "templates": [_template_to_json(t) for t in templates]}
                      for ops, ins, outs, templates, device in tasks]}).encode()
    except TypeError:
        return None


def _template_to_json(t):
    if not isinstance(t, tuple):
        return t  # None: an accumulator before its first gradient
    shape, stride, dtype, device, aligned, attrs = t
    return [list(shape), list(stride), str(dtype).removeprefix("torch."), str(device),
            aligned, attrs]


def _template_from_json(t):
    if not isinstance(t, list):
        return t
    shape, stride, dtype, device, aligned, attrs = t
    return (tuple(shape), tuple(stride), getattr(torch, dtype), torch.device(device), aligned,
            attrs)


def _task_from_json(d: dict) -> tuple:
    return ([op_from_row(r) for r in d["ops"]], d["ins"], d["outs"],
            [_template_from_json(t) for t in d["templates"]], torch.device(d["device"]))


def main(threads: str, offset: str) -> None:
    """A helper: build each task of its stdin, from `offset` round, with
    `threads` threads, leaving those another process is building."""
    torch.set_num_threads(int(threads))
    payload = json.loads(sys.stdin.buffer.read())
    for module in payload["modules"]:  # else a custom op is unknown here, and its run refused
        importlib.import_module(module)
    tasks = [_task_from_json(d) for d in payload["tasks"]]
    for task in tasks[int(offset):] + tasks[:int(offset)]:
        build_task(task, wait=False)


if __name__ == "__main__":
    main(*sys.argv[1:])
