"""train: a training run, from a Job, its weights and its data to a trained
model and its metrics.

Invariants:
- The ranks get the Job, the weights (tensors) and a data source: a
  `TokenFeed` (each rank reads only its own rows of the token file) or the
  global batches given in memory. Nothing else: no model config to rebuild.
- Evaluation runs the forward-only Job (`passes/plan.plan_forward`), lowered
  once per rank, on the validation split before the first step and after
  every `eval_every` steps.
- Metrics are written while the run goes on: each rank appends its step's
  row to its own file, and a step's metrics row is written once every rank
  has reported it (`StepMerger`). No overall time limit: a rank that makes
  no progress for `stall_s` ends the run (`runtime/launch.py`).
- The trained weights come back whole: every rank's final slices, placed at
  their boxes (`compare.assemble`), every element covered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.costmodel import known_device_models, load_device_model
from meshplan.costmodel.device import CPU_DEFAULT
from meshplan.data.feed import TokenFeed
from meshplan.driver.compare import assemble
from meshplan.driver.metrics import MetricsLog
from meshplan.driver.model_record import MODEL_FILE
from meshplan.driver.run import launch
from meshplan.driver.unread import UNREAD_FILE, start_values, write_unread
from meshplan.errors import KernelFault, RuntimeFault, TrainingHalted
from meshplan.ir import Phase, Role
from meshplan.ir.fileio import write_atomic
from meshplan.ir.job import Job
from meshplan.ops.infer import to_sig
from meshplan.ops.table import rule_for
from meshplan.runtime.checkpoint import COMPLETE, check_resumable
from meshplan.runtime.fused import check_kernels
from meshplan.runtime.worker import RunSpec

log_line = logging.getLogger("meshplan")


@dataclass(slots=True)
class TrainResult:
    """What a training run gives back."""

    losses: list[float]                       # per step, the global batch's mean loss
    evals: list[tuple[int, float]]            # (steps done, validation loss)
    weights: dict[str, torch.Tensor] = field(repr=False)  # FQN -> full tensor (aliases too)
    metrics: list[dict] = field(default_factory=list)    # the rows of metrics.jsonl
    rows_read: dict[str, int | None] = field(default_factory=dict)
    wall_s: float = 0.0
    first_step: int = 0


def step_flops(job: Job) -> float:
    """The FLOPs of one training step of `job`: every op's (exact for
    matmuls, attention and convolution; 0 for the rest) at its logical
    shapes, forward and backward once per micro-batch, the optimizer once.
    With recompute the recomputed forward counts too (hardware FLOPs)."""
    g, m = job.graph, job.strategy.num_microbatches
    total = 0.0
    for op in g.ops:
        fn = rule_for(op.kind).flops
        if fn is None:
            continue
        sig = to_sig(op.args, lambda i: g.values[i].meta)
        total += fn(sig) * (1 if op.phase is Phase.OPTIMIZER else m)
    return total


def peak_capacity(device: str, world: int, threads: int = 1,
                  dtype: str = "float32") -> tuple[float, str]:
    """MFU's denominator: the datasheet peak FLOP/s of the devices the local
    ranks run on. GPUs: one each (a known model, by its name). CPU: the
    ranks share this machine's cores, so its cores count (as many as the
    ranks' threads use), each at the calibrated `cpu-local` model's rate,
    else the built-in CPU default's (a guess, not a measurement). Returns
    (FLOP/s, the device model's name)."""

    if device == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for known in known_device_models():
            if known.split("-")[0] in name:
                return world * load_device_model(known).peak_flops_for(dtype), known
    try:
        model = load_device_model("cpu-local")
    except Exception:  # noqa: BLE001 - not calibrated: the default
        model = CPU_DEFAULT
    return model.peak_flops_for(dtype) * min(world * threads, os.cpu_count() or 1), model.name


class StepMerger:
    """Every rank's step rows (`steps_<rank>.jsonl`, appended as they run)
    merged into one metrics row per step, written once every rank has
    reported that step; evaluation rows once every loss holder has."""

    def __init__(self, results: Path, job: Job, log, tokens_per_step: int,
                 flops_per_step: float, capacity: float, base_lr: float):
        self.results, self.world, self.log = results, job.mesh.world, log
        self.stage_of = [job.strategy.stage_of_rank(r) for r in range(self.world)]
        self.tokens, self.flops = tokens_per_step, flops_per_step
        self.capacity = capacity
        self.base_lr = base_lr
        self.offsets = [0] * self.world
        self.pending: dict[int, dict[int, dict]] = {}
        self.evals: dict[int, dict[int, float | None]] = {}
        self.written: list[dict] = []
        self.eval_written: list[tuple[int, float]] = []

    def poll(self, final: bool = False) -> None:
        """Read what the ranks appended; write the rows now complete."""
        for r in range(self.world):
            self._read(r)
        for step in sorted(self.pending):
            if len(self.pending[step]) == self.world:
                self._write(step, self.pending.pop(step))
        for step in sorted(self.evals):
            got = self.evals[step]
            holders = [x for x in got.values() if x is not None]
            if len(got) == self.world or (final and holders):
                del self.evals[step]
                if holders:
                    self.log.log_eval(step, holders[0])
                    self.eval_written.append((step, holders[0]))

    def _read(self, r: int) -> None:
        path = self.results / f"steps_{r}.jsonl"
        if not path.is_file():
            return
        with open(path) as f:
            f.seek(self.offsets[r])
            text = f.read()
        complete = text[:text.rfind("\n") + 1]  # a line being written waits for the next poll
        self.offsets[r] += len(complete.encode())
        for line in complete.splitlines():
            row = json.loads(line)
            if "eval_step" in row:
                self.evals.setdefault(row["eval_step"], {})[r] = row["eval_loss"]
            else:
                self.pending.setdefault(row["step"], {})[r] = row

    def _write(self, step: int, rows: dict[int, dict]) -> None:
        losses = [x["loss"] for x in rows.values() if x["loss"] is not None]
        norms = [x["grad_norm"] for x in rows.values() if x["grad_norm"] is not None]
        lrs = [x["lr"] for x in rows.values() if x["lr"] is not None]
        step_s = max(x["step_s"] for x in rows.values())
        samples = [x["samples"] for x in rows.values() if x.get("samples") is not None]
        reports = {n: v for x in rows.values() for n, v in x.get("reports", {}).items()}
        row = {"step": step, "loss": losses[0] if losses else None,
               "grad_norm": norms[0] if norms else None,
               "lr": lrs[0] if lrs else self.base_lr,
               "tokens_per_s": self.tokens / step_s,
               "mfu": self.flops / step_s / self.capacity,
               "step_s": step_s, "peak_bytes": max(x["peak_bytes"] for x in rows.values()),
               "peak_bytes_per_stage": [max(x["peak_bytes"] for r, x in rows.items()
                                            if self.stage_of[r] == s)
                                        for s in range(max(self.stage_of) + 1)],
               "data_sha256": samples_digest(samples) if samples else None,
               "reports": reports or None}
        self.log.log_train(**row)
        self.written.append(row)


def samples_digest(parts) -> str:
    """The fingerprint of the samples a step read: the sha256 of their sorted
    distinct ids (int64), from the ranks' parts; equal for any two runs that
    read the same samples, whatever their layouts."""

    ids = np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    return hashlib.sha256(ids.tobytes()).hexdigest()


def train_job(job: Job, weights: dict[str, torch.Tensor], data, steps: int, out: str,
              *, eval_job: Job | None = None, eval_data=None, eval_every: int = 0,
              eval_batches: int = 0, checkpoint_every: int = 0, keep: int = 0,
              async_checkpoint: bool = False, resume_from: str = "", threads: int = 1,
              timeout_s: float = 300.0, stall_s: float = 300.0, device: str = "cpu",
              backend: str = "", kernels: str = "eager", tensorboard: bool | None = None,
              on_step=None,
              append: bool = False, record: dict | None = None,
              init_from: str = "", max_restarts: int = 0) -> TrainResult:
    """Train `job` from `weights` for `steps` steps on `job.mesh.world` local
    processes; `data` is a `TokenFeed` or a list of global batches (one per
    step). Metrics go to `out/metrics.jsonl` (and TensorBoard) as the steps
    finish; returns the losses, evaluations and the trained weights.

    With `checkpoint_every` the ranks save `out/checkpoints/step_<k>` every
    that many steps, and once one is complete only the newest `keep` complete
    ones are kept (0: all); with `async_checkpoint` the ranks save in the
    background and train on (`runtime/async_save.AsyncSaver`). `resume_from`
    (a complete checkpoint, of any layout) is where the run starts; its
    metrics are appended. Each
    checkpoint also holds `out/config.toml` (when the CLI wrote one) and
    `record` (`driver/model_record.py`) as `model.json`, written to `out`.
    `init_from` (`driver/init_from.weight_source`) is where the ranks read
    their starting weights, each its own slices; else `weights`. A rank that
    fails (killed, stalled) ends the attempt; with `max_restarts` the run
    restarts, up to that many times, from the newest complete checkpoint
    (metrics: a `resume` row, `driver/metrics.py`)."""

    t0 = time.perf_counter()
    tokens = isinstance(data, TokenFeed)
    unread = start_values(job, weights, init_from, resume_from)
    spec = run_spec(job, data, steps, out, record, unread, eval_job=eval_job, eval_data=eval_data,
                    eval_every=eval_every, eval_batches=eval_batches,
                    checkpoint_every=checkpoint_every, async_checkpoint=async_checkpoint,
                    resume_from=resume_from, threads=threads, timeout_s=timeout_s,
                    stall_s=stall_s, device=device, backend=backend, init_from=init_from,
                    kernels=kernels)
    per_step = job.strategy.global_batch_size * (data.seq_len if tokens else 1)
    saved = {"weights": weights, "batches": [] if tokens else list(data)}
    first = check_resumable(resume_from, job) if resume_from else 0
    rows: list[dict] = []            # earlier attempts' metrics rows, up to their restart
    evals: list[tuple[int, float]] = []
    with MetricsLog(out, tensorboard=tensorboard, append=append or bool(resume_from)) as log:
        if resume_from:
            log.log_resume(first, resume_from, "resumed")
        for attempt in range(max_restarts + 1):
            with tempfile.TemporaryDirectory(prefix="meshplan-train-") as results:
                merger = StepMerger(Path(results), job, log, per_step, step_flops(job),
                                    peak_capacity(device, job.mesh.world, threads)[0],
                                    OptimizerConfig.of_job(job).lr)

                def stepped(k: int, merger: StepMerger = merger) -> None:
                    merger.poll()
                    if keep:
                        prune_checkpoints(Path(out) / CHECKPOINTS, keep)
                    if on_step is not None:
                        on_step(k)

                try:
                    r = launch(job, spec, t0, saved=saved, on_step=stepped, results=results,
                               eval_job=eval_job)
                except RuntimeFault as e:
                    merger.poll(final=True)
                    point = _restart_point(e, out, attempt, max_restarts)
                    k = check_resumable(str(point), job)
                    rows = [x for x in rows + merger.written if x["step"] <= k]
                    evals = [x for x in evals + merger.eval_written if x[0] <= k]
                    log.log_resume(k, str(point), str(e))
                    log_line.warning("%s; restarting from %s (restart %d of %d)", e, point,
                                     attempt + 1, max_restarts)
                    spec = replace(spec, resume_from=str(point))
                    continue
                merger.poll(final=True)
                if keep:
                    prune_checkpoints(Path(out) / CHECKPOINTS, keep)
                break
    losses = [x["loss"] for x in rows] + r.losses
    return TrainResult(losses, evals + merger.eval_written,
                       trained_weights(job, r.state_slices, unread), rows + merger.written,
                       r.rows_read, time.perf_counter() - t0, first)


def run_spec(job: Job, data, steps: int, out: str, record: dict | None,
             unread: dict[str, torch.Tensor] | None, *, eval_job=None,
             eval_data=None, eval_every: int = 0, eval_batches: int = 0,
             checkpoint_every: int = 0, async_checkpoint: bool = False,
             resume_from: str = "", threads: int = 1, timeout_s: float = 300.0,
             stall_s: float = 300.0, device: str = "cpu", backend: str = "",
             init_from: str = "", kernels: str = "eager"):
    """What every rank of a training run is told (`RunSpec`); writes `record`
    as `out/model.json` and `unread` (`driver/unread.py`) as
    `out/unread_weights.pt`, copied, with `out/config.toml`, into each
    checkpoint (None: this process does not report the run)."""
    check_kernels(kernels, device)
    Path(out).mkdir(parents=True, exist_ok=True)
    if record is not None:
        write_atomic(Path(out) / MODEL_FILE, json.dumps(record, indent=1).encode())
    if unread is not None:
        write_unread(out, unread)
    files = tuple(str(Path(out) / f) for f in ("config.toml", MODEL_FILE, UNREAD_FILE)
                  if (Path(out) / f).is_file())
    return RunSpec(steps, "", threads, timeout_s, device=device,
                   backend=backend, kernels=kernels, report_state=True, step_rows=True,
                   stall_s=stall_s,
                   data=data.to_json() if isinstance(data, TokenFeed) else "",
                   eval_data=eval_data.to_json() if eval_data is not None else "",
                   eval_every=eval_every if eval_job is not None else 0,
                   eval_batches=eval_batches, resume_from=resume_from,
                   checkpoint_every=checkpoint_every, async_checkpoint=async_checkpoint,
                   checkpoint_root=str(Path(out) / CHECKPOINTS), checkpoint_files=files,
                   init_from=init_from, seed=data.seed if isinstance(data, TokenFeed) else 0)


def _restart_point(error: RuntimeFault, out: str, attempt: int, max_restarts: int) -> Path:
    """The newest complete checkpoint a failed attempt restarts from; the
    failure again when no restart is left, none is complete, or it would
    only fail the same way (a halt on a non-finite norm, a kernel's fault)."""
    done = complete_checkpoints(Path(out) / CHECKPOINTS)
    if attempt == max_restarts or isinstance(error, (TrainingHalted, KernelFault)):
        raise error
    if not done:
        raise RuntimeFault(f"{error}; no complete checkpoint to restart from yet (save them "
                           "with --checkpoint-every N)") from None
    return done[-1]


def trained_weights(job: Job, slices, unread: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `job`, whole, from the ranks' final
    slices, under each of its names (a tied weight's aliases too); one no
    rank holds because no op of the step reads it (a buffer, or a pooler's
    or another tower's weight that a text-only loss never uses: it gets no
    gradient, and torch's optimizers skip it) is its `unread` value, the
    one the run started it at (`driver/unread.start_values`)."""
    g = job.graph
    values = [g.values[i] for i in g.inputs if g.values[i].role in (Role.PARAM, Role.BUFFER)]
    got = assemble(slices, {v.name: tuple(v.meta.shape) for v in values})
    full = dict(got.tensors)
    read = g.consumers()
    for v in values:
        if v.name in got.uncovered:
            if v.name in got.tensors or (v.role is Role.PARAM and v.id in read):
                raise RuntimeFault(f"the ranks' final state leaves out part of '{v.name}'; "
                                   "this is meshplan's fault: report it")
            full[v.name] = unread[v.name]
    return {alias: t for name, t in full.items() for alias in g.names_of(name)}


CHECKPOINTS = "checkpoints"  # OUT/checkpoints/step_<k>: the checkpoint after k steps


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root` (`step_<k>` with its COMPLETE
    marker, written last), oldest first."""
    found = [p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; delete the older complete
    ones and any incomplete one older than the newest complete (a save cut
    short). A checkpoint is deleted only once a newer one is complete."""
    done = complete_checkpoints(root)
    if not done:
        return
    newest = int(done[-1].name[5:])
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step_*"):
        if p.name[5:].isdigit() and int(p.name[5:]) < newest and p not in done:
            shutil.rmtree(p, ignore_errors=True)


def tokens_to_steps(tokens: int, global_batch_size: int, seq_len: int) -> int:
    """The steps `--tokens N` asks for: enough to train on N tokens."""
    return max(1, math.ceil(tokens / (global_batch_size * seq_len)))
