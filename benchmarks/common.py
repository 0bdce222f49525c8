"""Shared benchmark helpers: machine facts, result files, a quiet machine,
rounds and medians; for the runtime benchmarks, their GPT, rank processes,
torch.distributed.pipelining's stages, and a count of live storages.

Invariants:
- Every runtime configuration trains the GPT of `SHAPE` from seed 0 (built
  on the CPU, then moved) on `batches(steps)` (step k's batch from seed k)
  with `sgd`, so losses compare across configurations.
- A rank process started by `spawn_ranks` writes `<out>/<rank>.json` once;
  `spawn_ranks` returns them in rank order.
- A pipeline step is timed between two barriers (`timed_steps`): every
  rank's time is the pipeline's, up to the barriers' skew.
- `LiveStorages` counts a storage once, at its current size, from the
  first op that reads or writes it until torch frees it (views and
  autograd's saved tensors keep it).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from meshplan.autodiff.optimizer import OptimizerConfig, torch_optimizer
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime.devices import rank_device
from meshplan.runtime.launch import free_port
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.trace import Span, Track

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(layers=8, hidden=128, heads=4, seq_len=64, vocab=1024)
BATCH, WARMUP = 16, 2
LOSS_TOLERANCE = 1e-4  # max |diff| of two configurations' losses (fp32, SGD steps)
TIMEOUT = datetime.timedelta(seconds=60)  # a hung rank fails instead of blocking the run
LOSS_SPAN = "loss"  # TorchPipeline's span of torch's loss_fn call (meshplan's F holds it)


def machine() -> dict:
    return {
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write(name: str, result: dict, table: str) -> None:
    """Write results/<name>.json and results/<name>.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(table)
    print(table)


# ------------------------------------------------------------------ a quiet machine
def cpu_busy(interval_s: float = 0.5) -> float:
    """Fraction of all CPUs busy over `interval_s` (Linux /proc/stat; else 0)."""
    def read() -> tuple[int, int]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(f), f[3] + f[4]  # total, idle + iowait
    try:
        t0, i0 = read()
        time.sleep(interval_s)
        t1, i1 = read()
    except OSError:
        return 0.0
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(limit_s: float = 10.0, busy: float = 0.15) -> float:
    """Wait (at most `limit_s`) until other processes leave the CPUs; returns
    the busy fraction last seen. Measured: this machine is shared, and a
    burst of other work doubles a 2-rank step."""
    end = time.monotonic() + limit_s
    seen = cpu_busy()
    while seen > busy and time.monotonic() < end:
        seen = cpu_busy()
    return seen


# ------------------------------------------------------------------ rounds
def alternate(runs: dict, rounds: int) -> dict[str, dict]:
    """Every `runs[k]()` once per round, round after round, each after the
    CPUs are quiet, so that bursts of load from other processes on the
    machine spread over all of them: {k: {"rounds": [what it returned, per
    round], "busy_before": [the CPUs' busy fraction before it, per round]}}."""
    out: dict[str, dict] = {k: {"rounds": [], "busy_before": []} for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            out[k]["busy_before"].append(wait_quiet())
            out[k]["rounds"].append(fn())
    return out


def timed_median(rounds: list[list[float]]) -> float:
    """The median of every round's steps after the warm-up."""
    return median([s for r in rounds for s in r[WARMUP:]])


def best_round(rounds: list[list[float]]) -> float:
    """The quietest round's median: a companion to the median when other
    processes load the machine during some rounds."""
    return min(median(r[WARMUP:]) for r in rounds)


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------ the GPT
def cfg():
    return model_config("gpt", "tiny", **SHAPE)


def batches(steps: int) -> list:
    """The batches meshplan's worker trains on (seed 0 + step)."""
    return [example_batch(cfg(), BATCH, seed=s) for s in range(steps)]


def torch_step(module, opt, data):
    """One eager PyTorch training step of `module` on `data` (its loss as a float)."""
    def step():
        opt.zero_grad(set_to_none=True)
        loss = module(*data)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def sgd(named) -> torch.optim.Optimizer:
    """meshplan's default SGD on (name, parameter) pairs."""
    return torch_optimizer(OptimizerConfig.default("sgd"), named)


# ------------------------------------------------------------------ rank processes
def spawn_ranks(fn, args: tuple, nprocs: int) -> list[dict]:
    """`fn(rank, port, out, *args)` in `nprocs` processes; each rank's JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as out:
        tmp.spawn(fn, args=(free_port(), out, *args), nprocs=nprocs, join=True)
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(nprocs)]


def write_rank(out: str, rank: int, result) -> None:
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def join_group(rank: int, port: int, world: int, device: str = "cpu") -> torch.device:
    """One thread; this rank's device (cuda: its own GPU, nccl for tensors on
    it, gloo for the rest); the process group over 127.0.0.1."""
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    dev = rank_device(device, rank, backend)
    dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    if backend == "nccl":  # the first NCCL call must involve every rank
        dist.all_reduce(torch.zeros(1, device=dev))
    return dev


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, steps: list, device: torch.device) -> tuple[list[float], list[float]]:
    """`step(batch)` (the step's mean loss, or None on a rank without one)
    for each batch, between barriers: (losses, seconds per step)."""
    losses, times = [], []
    for batch in steps:
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(batch)
        sync(device)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        if loss is not None:
            losses.append(loss)
    return losses, times


def meshplan_rank(job_path: str, rank: int, device: torch.device, config=None,
                  kernels: str = "eager"):
    """(executor, state) of `rank` for the Job at `job_path`, lowered here for
    `device`, its state sliced from the seed-0 weights of the GPT of `config`
    (default `cfg()`); `kernels` as `--kernels`."""
    from meshplan.ir.job import Job
    from meshplan.lowering.lower import lower
    from meshplan.runtime.comm import Comm, job_groups
    from meshplan.runtime.rank_executor import RankExecutor

    job = Job.from_bytes(Path(job_path).read_bytes())
    backend = "nccl" if device.type == "cuda" else "gloo"
    comm = Comm(rank, job_groups(job.strategy, job.graph.ops), backend, device)
    ex = RankExecutor(job, lower(job, rank, device.type), comm, device=device, kernels=kernels)
    torch.manual_seed(0)
    return ex, ex.init_state(build_model(config or cfg()))


# ------------------------------------------------------------------ torch pipelining
class Chunk(nn.Module):
    """Blocks of `stage` of `stages` equal stages of one GPT; the first
    stage embeds, the last projects."""

    def __init__(self, model: nn.Module, stage: int, stages: int):
        super().__init__()
        per = len(model.blocks) // stages
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleList(model.blocks[stage * per:(stage + 1) * per])
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, SHAPE["vocab"]), targets.view(-1))


def _example_io(stage: int, stages: int, micro: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t, h = SHAPE["seq_len"], SHAPE["hidden"]
    # requires_grad on the examples: the stage's metadata says which
    # activations get gradients (without it backward sees no output grads).
    x = (torch.zeros(micro, t, dtype=torch.long, device=device) if stage == 0
         else torch.zeros(micro, t, h, requires_grad=True, device=device))
    y = torch.zeros(micro, t, SHAPE["vocab"] if stage == stages - 1 else h,
                    requires_grad=True, device=device)
    return x, y


class TorchPipeline:
    """torch.distributed.pipelining's `schedule` (a class name) on this rank's
    `stage_ids` of `stages`, `m` micro-batches of `micro`, SGD; `compiled`:
    each stage's module through `torch.compile` (Inductor). With `spans`
    a list, a step appends one `Span` per stage compute call (named as
    meshplan's actions: F, B, or I and W), per loss and for the optimizer."""

    def __init__(self, schedule: str, stage_ids: list[int], stages: int, micro: int, m: int,
                 device: torch.device, compiled: bool = False):
        from torch.distributed import pipelining

        torch.manual_seed(0)
        model = build_model(cfg())  # on the CPU: the same weights on every device
        self.device, self.spans = device, None
        self.stages = []
        for s in stage_ids:
            x, y = _example_io(s, stages, micro, device)
            chunk = Chunk(model, s, stages).to(device)
            stage = pipelining.PipelineStage(torch.compile(chunk) if compiled else chunk, s,
                                             stages, device, input_args=x, output_args=y)
            self._trace(stage)
            self.stages.append(stage)
        cls = getattr(pipelining, schedule)
        single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)  # one stage
        self.schedule = cls(self.stages[0] if single else self.stages, n_microbatches=m,
                            loss_fn=self._loss)
        self.opt = sgd([np for st in self.stages for np in st.submod.named_parameters()])

    def step(self, batch) -> float | None:
        """One training step; the mean loss over the micro-batches, if held here."""
        tokens, targets = (t.to(self.device) for t in batch)
        mb_losses: list = []
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step(tokens, target=targets, losses=mb_losses)
        with self._span("STEP"):
            self.opt.step()
        if not mb_losses:
            return None
        return float(torch.stack([x.detach() for x in mb_losses]).mean())

    def traced_step(self, batch) -> tuple[float, list[Span]]:
        """`step` with its spans on: (this rank's wall seconds, the spans)."""
        self.spans = spans = []
        t0 = time.perf_counter()
        try:
            self.step(batch)
            sync(self.device)
        finally:
            self.spans = None
        return time.perf_counter() - t0, spans

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self._span(LOSS_SPAN):
            return lm_loss(logits, targets)

    def _span(self, name: str):
        return _Timed(self, name)

    def _trace(self, stage) -> None:
        """Time the stage's compute calls (only while `spans` is a list)."""
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        weight, index = stage.backward_weight_one_chunk, stage.stage_index

        def name(kind: ActionType, mb: int) -> str:
            return str(Action(index, kind, mb))

        def forward_one_chunk(mb, *args, **kwargs):
            with self._span(name(ActionType.F, mb)):
                return forward(mb, *args, **kwargs)

        def backward_one_chunk(mb, *args, full_backward=True, **kwargs):
            kind = ActionType.B if full_backward else ActionType.I
            with self._span(name(kind, mb)):
                return backward(mb, *args, full_backward=full_backward, **kwargs)

        def backward_weight_one_chunk(mb, *args, **kwargs):
            with self._span(name(ActionType.W, mb)):
                return weight(mb, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk


class _Timed:
    """A span of `pipe.spans` around a block, when `spans` is a list."""

    def __init__(self, pipe: TorchPipeline, name: str):
        self.pipe, self.name = pipe, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.pipe.spans is not None:
            sync(self.pipe.device)
            self.pipe.spans.append(Span(self.name, Track.COMPUTE, self.t0, time.perf_counter()))


# ------------------------------------------------------------------ live storages
class LiveStorages(TorchDispatchMode):
    """While on, every storage an op reads or writes counts in `live` at its
    current size, polled after every op (a storage resized in place, as
    FSDP2 frees and refills its unsharded parameters, counts as it is),
    until torch frees it; `peak` is `live`'s high-water mark since
    `reset_peak`. A DTensor counts by its local tensor. A storage's Python
    object lives as long as the storage (torch keeps it), so a weak
    reference to it ends with the storage."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._held: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            self._add(t)
        self.peak = max(self.peak, self._poll())
        return out

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(t):  # a DTensor: its local tensor
            for attr in t.__tensor_flatten__()[0]:
                self._add(getattr(t, attr))
            return
        storage = t.untyped_storage()
        self._held[id(storage)] = storage

    def _poll(self) -> int:
        self.live = sum(s.nbytes() for s in self._held.values())
        return self.live

    def reset_peak(self) -> None:
        self.peak = self._poll()


# ------------------------------------------------------------------ plan --auto as a user runs it
def plan_auto(args: list[str]) -> dict:
    """`meshplan plan --auto ... --json` (`args`) in a fresh process, once
    the CPUs are quiet: its wall clock, the search's and the proof's own
    seconds, and the winner (its row of the table)."""
    wait_quiet()
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "meshplan", *args], capture_output=True,
                       text=True, check=True)
    wall = time.perf_counter() - t
    got = json.loads(r.stdout)
    win = next(row for row in got["top"] if row.get("winner"))
    return {"wall_s": wall, "search_s": got["search_s"] - got["proof_s"],
            "proof_s": got["proof_s"], "full_plans": got["full_plans"],
            "candidates": got["candidates"], "probes": got["probes"],
            "winner": win["strategy"], "ep": win["ep"], "cp": win["cp"],
            "planned_peak_gib": max(win["planned_peak_bytes"]) / 2**30,
            "limit_gib": got["memory_limit_bytes"] / 2**30, "step_s": win["planned_step_s"],
            "tflops_per_device": win["tflops_per_device"]}
