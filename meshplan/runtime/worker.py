"""The body of one rank's process: join the group, lower (or load) its own
plan, train, report.

Invariants:
- A rank lowers only its own plan, from the Job's bytes (rank 0's master
  made them); nothing else crosses processes but tensors.
- A rank decodes only its stage's view of the Job (`JobReader.view`): its
  plan, its groups (`comm.rank_groups`), its state and its checkpoint
  slices come from that view. Rank 0 also decodes every stage's values,
  and only when it writes a checkpoint's manifest (`checkpoint.SavedJob`).
- A rank never builds a model: it gets the Job, the module's weights
  (tensors: the launcher's `module_file`, or in memory under torchrun,
  where the driver of each process builds them) and its data source (the
  batches given, or its own rows of a token file), so every rank slices the
  very weights the eager reference starts from.
- Any exception is written to `<results>/fail_<rank>.json` with the action
  the rank was in, then the process exits non-zero; the launcher reports it.
- Every collective is bounded by the process group's timeout.
- On `--device cuda` a rank takes its GPU (`runtime/devices.py`) before it
  joins; with NCCL the group has two backends, `cpu:gloo,cuda:nccl`, so the
  few CPU tensors (the Job's bytes, results) still move. Step times are
  CUDA-event times and the measured peak is the allocator's.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from meshplan.errors import RuntimeFault
from meshplan.ir.fileio import write_atomic
from meshplan.ir.job import JobReader, StageView
from meshplan.ops.device_kernels import FALLBACKS, RAN
from meshplan.runtime import checkpoint
from meshplan.runtime.agreement import agree
from meshplan.runtime.async_save import AsyncSaver
from meshplan.runtime.comm import Comm, broadcast_bytes, gather_bytes, rank_groups
from meshplan.runtime.data import batch_feed, token_feed
from meshplan.runtime.devices import rank_device
from meshplan.runtime.evaluate import Evaluator
from meshplan.runtime.init_weights import load_weights
from meshplan.runtime.own_plan import rank_plan
from meshplan.runtime.progress import StepRows, progress_only, reporter, start_liveness
from meshplan.runtime.rank_executor import NonFiniteNorm, RankExecutor, halted
from meshplan.runtime.rank_result import ALL_RANKS, RankResult, result_name
from meshplan.runtime.tensor_file import STATE, load_inputs, write_tensors


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What every rank needs besides the Job and the weights: the data
    source, the steps, where to report."""

    steps: int
    results: str = ""
    threads: int = 1
    timeout_s: float = 60.0
    device: str = "cpu"              # cpu | cuda (resolved: never auto)
    backend: str = ""                # gloo | nccl; "" = nccl on cuda, gloo on cpu
    plan_dir: str = ""
    trace: bool = False
    save_dir: str = ""
    resume: bool = False
    gather: bool = False
    module_file: str = ""  # the module's weights and the batches given (tensors only)
    report_state: bool = False  # write the final state's slices (verify compares them)
    data: str = ""        # a `TokenFeed` (JSON): each rank reads its own rows of a token file
    eval_data: str = ""   # the validation split's `TokenFeed` (JSON)
    eval_job: str = ""    # the forward-only Job's file (`passes/plan.plan_forward`)
    eval_every: int = 0   # evaluate before the first step and after every this many
    eval_batches: int = 0
    step_rows: bool = False  # append each step's row to `<results>/steps_<rank>.jsonl`
    stall_s: float = 300.0   # a rank with no action for this long ends the run (launcher)
    resume_from: str = ""    # a checkpoint to start from (else save_dir with resume)
    checkpoint_every: int = 0  # save `<checkpoint_root>/step_<k>` after every this many steps
    checkpoint_root: str = ""
    checkpoint_files: tuple[str, ...] = ()  # copied into each checkpoint (config, model record)
    init_from: str = ""   # the starting weights' source (JSON: `runtime/init_weights.py`)
    async_checkpoint: bool = False  # periodic checkpoints saved in the background
    seed: int = 0  # the random ops' seed (a resumed run takes its checkpoint's)
    kernels: str = "eager"  # eager | inductor (`runtime/fused.py`)

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in self.__slots__})

    @staticmethod
    def from_json(text: str) -> RunSpec:
        fields = json.loads(text)
        fields["checkpoint_files"] = tuple(fields.get("checkpoint_files", ()))
        return RunSpec(**fields)


def _groups(plan) -> list[tuple[int, ...]]:
    return sorted({t.group for t in plan.tasks if len(t.group) > 1})


def rank_main(spec: RunSpec, rank: int, world: int, job_bytes: bytes | None,
              init_method: str | None = None, progress=None, master=None,
              steps_done=None, beats=None, source=None) -> int:
    """Run one rank; returns its exit code (0 ok, 1 failed and reported).

    Under torchrun `job_bytes` is None: rank 0 runs `master()` (capture and
    planning) and broadcasts the Job's bytes; every rank lowers itself, and
    `source` (weights, batches) comes from the driver of its own process.
    `progress[rank]` is set to each action's index before it runs,
    `steps_done[rank]` to the steps finished (counting resumed ones),
    `beats[rank]` to `time.monotonic()` at each action (the rank's last
    progress), and `beats[world + rank]` every half second while the process
    runs (its liveness): the launcher's stall check reads both."""
    try:
        torch.set_num_threads(spec.threads)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        backend = spec.backend or ("nccl" if spec.device == "cuda" else "gloo")
        device = rank_device(spec.device, rank, backend)  # before NCCL: it needs the GPU
        if world > 1 or init_method:
            # With NCCL, CPU tensors (the Job's bytes, results, the fp16 flag)
            # still go through gloo: one process group, two backends.
            pg = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
            dist.init_process_group(pg, rank=rank, world_size=world, timeout=timeout,
                                    **_rendezvous(init_method, rank, world, timeout))
        if job_bytes is None:
            job_bytes = broadcast_bytes(master() if rank == 0 else None, src=0)
        return _train(spec, JobReader(job_bytes, "the Job"), rank, world, progress, steps_done,
                      device, backend, beats, source)
    except (Exception, CheckpointException) as e:  # reported; the launcher ends the others
        ex = _CURRENT.get("executor")
        where = ex.current if ex is not None else "setup"
        fail = {"rank": rank, "action": where, "time": time.time(),
                "error": f"{type(e).__name__}: {e}"[:500],
                "exit_code": getattr(e, "exit_code", 1),
                "traceback": traceback.format_exc()[-4000:]}
        Path(spec.results).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(spec.results) / f"fail_{rank}.json", json.dumps(fail).encode())
        return 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        # The executor, freed now: a spawned rank ends in `os._exit`, which runs
        # no destructor, and an AOTInductor run's loader deletes the folder it
        # unpacked its package into (/tmp/aotinductor_*, 3.5 MB) only in its own.
        _CURRENT.clear()
        gc.collect()


_CURRENT: dict = {}


def _rendezvous(init_method: str | None, rank: int, world: int, timeout) -> dict:
    """How the process group meets: `init_method`, or under torchrun (env://)
    its store with a prefix per torchrun restart, for torchrun's store
    outlives a restart and the last attempt's addresses are still in it."""
    if init_method != "env://":
        return {"init_method": init_method}
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"meshplan/attempt_{attempt}", store)}


def _train(spec: RunSpec, reader: JobReader, rank: int, world: int, progress=None,
           steps_done=None, device=None, backend: str = "gloo", beats=None,
           source=None) -> int:
    if world != reader.mesh.world:
        raise RuntimeFault(f"the plan is for {reader.mesh.world} ranks but {world} were "
                           "started; start as many ranks as the plan's mesh has")
    view = reader.view(reader.strategy.stage_of_rank(rank))
    saved_job = checkpoint.SavedJob(reader)
    device = device if device is not None else torch.device(spec.device)
    plan = rank_plan(view, rank, device.type, spec.plan_dir)
    comm = Comm(rank, rank_groups(view.strategy, rank, view.ops), backend, device) \
        if world > 1 else None
    if backend == "nccl" and world > 1:  # the first NCCL call must involve every rank
        dist.all_reduce(torch.zeros(1, device=device))   # (batch_isend_irecv's rule)
    missing = set(_groups(plan)) - set(comm.groups if comm else ())
    assert not missing, f"plan uses groups the strategy does not make: {sorted(missing)}"
    if comm is not None:  # before step 0: this rank's plan against its peers'
        agree(plan, view, comm.groups)
    ex = RankExecutor(view, plan, comm, device=device, seed=spec.seed, kernels=spec.kernels)
    _CURRENT["executor"] = ex
    ex.on_action = reporter(rank, progress, beats)
    module, feed = _source(spec, view, ex, source)
    state = ex.init_state(module)
    evaluator = _evaluator(spec, ex.ctx, comm, device, progress_only(beats, rank))
    start = 0
    resume_from = spec.resume_from or (spec.save_dir if spec.resume else "")
    if resume_from:
        ex.current = "load checkpoint"
        resumed = checkpoint.load(resume_from, state, ex.ctx, device)
        start, ex.good_steps = resumed.next_step, resumed.good_steps
        ex.next_step = start
    elif spec.init_from:
        ex.current = "load weights"
        load_weights(spec.init_from, state, ex.ctx)
    # made once by every rank alike: the background saves' own collectives
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=spec.timeout_s)) \
        if spec.async_checkpoint and dist.is_initialized() else None
    saver = AsyncSaver(group) if spec.async_checkpoint else None  # runtime/async_save.py
    done = _loop(spec, ex, comm, state, feed, evaluator, start, rank, device, steps_done, saver,
                 saved_job)
    losses, norms, times, trace, skipped, rows_read, reports = done
    if spec.save_dir:
        ex.current = "save checkpoint"
        end = max(start, spec.steps)
        checkpoint.save(spec.save_dir, checkpoint.stage(state, ex.ctx, end,
                                                        good_steps=ex.good_steps, device=device),
                        saved_job, end)
    if spec.report_state and not spec.gather:
        write_tensors(Path(spec.results) / f"state_{rank}.bin", STATE,
                      checkpoint.state_slices(state, ex.ctx))
    result = RankResult(rank, losses, norms, skipped, times, start, plan.memory.peak_bytes(),
                        dict(plan.memory.peak), measured_peak(device, ex.mem), ex.mem.peak,
                        str(device), dict(FALLBACKS), dict(RAN), trace, rows_read, reports,
                        *ex.kernel_compile())
    data = result.to_json().encode()
    if spec.gather:  # no shared file system (torchrun): results travel as bytes

        data = json.dumps([json.loads(b) for b in gather_bytes(data)]).encode()
        if rank != 0:
            return 0
        write_atomic(Path(spec.results) / ALL_RANKS, data)
        return 0
    write_atomic(Path(spec.results) / result_name(rank), data)
    return 0


def _source(spec: RunSpec, view: StageView, ex, given=None):
    """The module's initial weights and `feed(step) -> (micro-batches,
    local_rows)`: from `given` (weights, batches) in memory, or the
    launcher's `module_file` (tensors only: `runtime/tensor_file.py`); the
    data the batches given, or this rank's own rows of a token file
    (`spec.data`)."""
    if given is not None:
        weights, batches = given
    else:

        weights, batches = load_inputs(Path(spec.module_file))
    if spec.data:
        return weights, token_feed(spec.data, view.strategy, ex.rows)
    return weights, batch_feed(batches, view.strategy.num_microbatches)


def _loop(spec: RunSpec, ex, comm, state: dict, feed, evaluator, start: int, rank: int,
          device, steps_done, saver, saved_job):
    """The steps from `start` to `spec.steps`, evaluating and checkpointing
    as asked (through `saver`, an `AsyncSaver`, in the background: a finished
    save is marked complete at the next step's start, the last one waited
    for at the end); returns (losses, norms, step times, trace, skipped
    steps, rows read, reports: name -> per step)."""
    losses, norms, times, trace, skipped = [], [], [], None, []
    reports: dict[str, list] = {}
    clock = StepClock(device)
    rows = StepRows(Path(spec.results) / f"steps_{rank}.jsonl" if spec.step_rows else None,
                    lambda: measured_peak(device, ex.mem))
    if evaluator is not None and start == 0:
        rows.eval(0, evaluator.run(state))
    for step in range(start, spec.steps):
        if saver is not None:
            ex.current = "async checkpoint"
            saver.poll()
        clock.start()
        mbs, local = feed(step)
        if spec.trace and step == spec.steps - 1:
            out, trace = _traced_step(ex, comm, state, mbs, local)
        else:
            try:
                out = ex.step(state, mbs, local)
            except NonFiniteNorm as e:
                raise halted(step, e, ex.step_losses.values()) from None
        if ex.nonfinite is not None:  # skipped, on every rank alike
            skipped.append(step)
        times.append(clock.stop())
        loss = float(torch.stack(out).mean()) if out else None
        if loss is not None:
            losses.append(loss)
        norm = ex.grad_norm(state)
        if norm is not None:
            norms.append(norm)
        step_reports = {n: t.tolist() for n, t in ex.step_reports.items()}
        for name, value in step_reports.items():
            reports.setdefault(name, []).append(value)
        reader = getattr(feed, "reader", None)
        rows.train(step + 1, loss, norm, state, times[-1],
                   reader.step_samples if reader is not None else None, step_reports)
        if evaluator is not None and (step + 1) % spec.eval_every == 0:
            rows.eval(step + 1, evaluator.run(state))
        if spec.checkpoint_every and (step + 1) % spec.checkpoint_every == 0:
            _checkpoint(spec, ex, state, step + 1, device, saver, saved_job)
        if steps_done is not None:
            steps_done[rank] = step + 1
    if saver is not None:
        ex.current = "async checkpoint"
        saver.wait()
    reader = getattr(feed, "reader", None)
    return losses, norms, times, trace, skipped, reader.rows_read if reader else None, reports


def _checkpoint(spec: RunSpec, ex, state: dict, next_step: int, device, saver,
                saved_job: checkpoint.SavedJob) -> None:
    """Save `<checkpoint_root>/step_<next_step>`: now, or started in the
    background (host copies staged first) when `saver` is given."""
    ex.current = "save checkpoint"
    path = str(Path(spec.checkpoint_root) / f"step_{next_step}")
    staged = checkpoint.stage(state, ex.ctx, next_step, good_steps=ex.good_steps,
                              device=device, copy=saver is not None)
    if saver is None:
        checkpoint.save(path, staged, saved_job, next_step, spec.checkpoint_files)
    else:
        saver.start(path, staged, saved_job, next_step, spec.checkpoint_files)


def _evaluator(spec: RunSpec, train_ctx, comm, device, on_action):
    """The forward-only plan's executor over the validation feed, or None."""
    if not spec.eval_job or spec.eval_every <= 0:
        return None

    eval_view = JobReader(Path(spec.eval_job).read_bytes(), spec.eval_job).view(train_ctx.stage)
    return Evaluator(eval_view, train_ctx, comm, device,
                     spec.eval_data, spec.eval_batches, on_action)


def _traced_step(ex, comm, state: dict, mbs, local: bool = False) -> tuple[list, list]:
    """One step with every action and collective timed: its losses, and its
    spans (`Span.to_json` rows) in seconds from a barrier all ranks leave
    together, so ranks on different machines share the origin up to the
    barrier's skew."""
    if dist.is_initialized():
        dist.barrier()
    origin = time.perf_counter()
    spans: list = []
    ex.spans = spans
    if comm is not None:
        comm.spans = spans
    try:
        out = ex.step(state, mbs, local)
    finally:
        ex.spans = None
        if comm is not None:
            comm.spans = None
    return out, [replace(s, start=s.start - origin, end=s.end - origin).to_json()
                 for s in spans]


class StepClock:
    """Step time: CUDA events on a GPU (recorded on the compute stream, read
    after the step's last kernel), `perf_counter` on CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.t0
        self.end.record()
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3


def measured_peak(device, live) -> int:
    """The measured peak: the CUDA caching allocator's on a GPU (every tensor
    of the process, workspaces too), else meshplan's own live-bytes count."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return live.peak


def spawn_entry(spec_json: str, rank: int, world: int, job_path: str, port: int,
                progress=None, steps_done=None, beats=None) -> None:
    """Target of a locally spawned rank process."""
    spec = RunSpec.from_json(spec_json)
    job_bytes = Path(job_path).read_bytes()
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
    if beats is not None:
        start_liveness(beats, world + rank)
    code = rank_main(spec, rank, world, job_bytes, f"tcp://127.0.0.1:{port}", progress,
                     steps_done=steps_done, beats=beats)
    raise SystemExit(code)
