"""Sharded data parallel: meshplan --zero 0, 1, 2, 3 beside torch's DDP and
FSDP2, per rank: memory layoutned and measured, bytes communicated, step time.

Setup: the zoo's GPT small (8 layers, hidden 256, 8 heads, seq 128, vocab
1024, 6.9M parameters) on 4 gloo processes over 127.0.0.1 (dp=4), one thread
each, CPU, AdamW (lr 1e-3, weight decay 0.01); global batch 16 = 2
micro-batches x 2 samples x 4 ranks, each micro-batch's loss scaled by 1/2.
Every configuration builds the GPT from seed 0 and trains on the same
batches (step k's from seed k); rank r takes rows [2r, 2r+2) of each
micro-batch of 8, as meshplan's dp slicing does.
- meshplan zero z: `Strategy(dp=4, zero=z)`, default gradient buckets
  (25 MiB), its rank executor run here directly.
- DDP: `DistributedDataParallel` (default 25 MB buckets), `no_sync()` for
  every micro-batch but the last.
- FSDP2: `fully_shard` on each block, then on the root;
  `set_requires_gradient_sync(False)` for every micro-batch but the last.

Measured, the same way for every configuration:
- step time: the max over ranks of a step timed between barriers
  (`common.timed_steps`); the median of the steps after the warm-up over
  all rounds. Configurations alternate round by round (`common.alternate`),
  each started once the CPUs are quiet (the machine is shared).
- CPU per step: each rank's process (all its threads, gloo's included) and
  main thread (`time.process_time`, `time.thread_time`) around its step,
  summed over the ranks; the median over the rounds' steps. The 4 ranks
  share the machine's 2 cores, so a step lasts about this over 2.
- once per configuration, before the rounds, an accounting run of
  WARMUP + 1 steps, on its last step:
  - bytes communicated per rank: c10d's flight recorder
    (`TORCH_FR_BUFFER_SIZE`, on in this run only: it costs time), which
    records every collective a process group runs, whoever calls it
    (meshplan, FSDP2, or DDP's C++ reducer), with its input and output
    sizes; the records between the step's two barriers. "bytes" is the
    larger of a collective's input and output (an all-gather's gathered
    tensor, an all-reduce's tensor); "ring bytes" what a ring algorithm
    sends per rank for it: 2(n-1)/n of an all-reduce, (n-1)/n of the rest.
  - live bytes peak per rank: `common.LiveStorages`, on from before the
    model is built, peak over the step (a storage counts at its current
    size after every op, so FSDP2's resized parameter storages count as
    they are); for meshplan also its executor's own count (`ex.mem`) and
    the plan's peak by category (`lower(job, rank).memory.peak`).
  - state at rest per rank, after the step: the bytes (numel x element
    size) of the rank's parameters, gradients and optimizer state as it
    holds them (FSDP2: the DTensors' local shards; meshplan: its state).
Targets (met / NOT met): optimizer-state bytes per rank at zero >= 1 and
parameter bytes at zero 3 are 1/dp of zero 0's within padding (one row of
each split tensor, and the unsplit scalars); meshplan zero 3 <= 1.0 x FSDP2
and zero 0 <= 1.0 x DDP in median step time; every configuration's losses
(timed round 0, mean over ranks) equal DDP's within 1e-5 relative
(asserted, after the results are written). A missed step-time target runs
both configurations it compares once more with their phases timed
(`harness.profiled_step` for meshplan, timers around torch's forward,
backward and optimizer calls) and their communication spans (meshplan's
collectives; FSDP2's parameter-group calls), to say where the time goes.

Run: python benchmarks/sharded_dp.py [--steps K] [--rounds R] [--picture PNG]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    WARMUP,
    LiveStorages,
    alternate,
    best_round,
    join_group,
    machine,
    meshplan_rank,
    spawn_ranks,
    timed_median,
    timed_steps,
    wait_quiet,
    write,
    write_rank,
)
from harness import phase_seconds, profiled_step  # noqa: E402

from meshplan.autodiff.optimizer import OptimizerConfig, torch_optimizer  # noqa: E402
from meshplan.driver.plan import plan_model, zoo_strategy  # noqa: E402
from meshplan.ir.fileio import write_atomic  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.ir.state_name import GRAD, SEP  # noqa: E402
from meshplan.models import build_model, example_batch, model_config  # noqa: E402
from meshplan.runtime.data import split_microbatches  # noqa: E402
from meshplan.schedules.trace import Span, Track  # noqa: E402

DP, BATCH, MICRO = 4, 16, 2
M = BATCH // (MICRO * DP)  # micro-batches per step
ZEROS = (0, 1, 2, 3)
LOSS_RTOL = 1e-5
FR_ENTRIES = 4096  # the flight recorder's ring: more than one step's collectives
PROFILE_STEPS = 3
TARGETS = {"zero3_vs_fsdp2": 1.0, "zero0_vs_ddp": 1.0}
CATEGORIES = ("param", "grad", "optimizer")
CPU = torch.device("cpu")
MiB = 2 ** 20


def cfg():
    return model_config("gpt", "small")


def batches(first: int, n: int) -> list:
    """Steps first .. first+n-1's global batches (step k's from seed k)."""
    return [example_batch(cfg(), BATCH, seed=k) for k in range(first, first + n)]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def row_bytes(t: torch.Tensor) -> int:
    """One slice of `t` along its first dimension longer than 1 (the one a
    near-equal split cuts), or all of it if none: what padding may add."""
    dims = [n for n in t.shape if n > 1]
    return nbytes(t) // dims[0] if dims else nbytes(t)


def at_rest(tensors: dict[str, list[torch.Tensor]]) -> dict:
    """Bytes per category, and the padding allowance of each (`row_bytes`)."""
    return {"bytes": {k: sum(nbytes(t) for t in ts) for k, ts in tensors.items()},
            "pad": {k: sum(row_bytes(t) for t in ts) for k, ts in tensors.items()}}


def comm_kinds(spans: list[Span], n: int) -> dict[str, float]:
    """Seconds per step (over `n` steps) in communication spans, by name."""
    out: dict[str, float] = defaultdict(float)
    for s in spans:
        out[s.name] += (s.end - s.start) / n
    return dict(out)


# ------------------------------------------------------------------ trainers
class MeshplanTrainer:
    """meshplan's rank executor for the Job at `job_path`, on this rank."""

    def __init__(self, job_path: str, rank: int):
        self.ex, self.state = meshplan_rank(job_path, rank, CPU, cfg())

    def step(self, b) -> float:
        """One step; the mean loss over the micro-batches (every rank holds it)."""
        losses = self.ex.step(self.state, split_microbatches(b, M))
        return float(torch.stack(losses).mean())

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list] = {k: [] for k in CATEGORIES}
        for name, t in self.state.items():
            if t is not None:
                slot = name.rpartition(SEP)[2] if SEP in name else ""
                out["param" if not slot else "grad" if slot == GRAD else "optimizer"].append(t)
        return out

    def profiled(self, b) -> tuple[float, list[Span], list[Span]]:
        """A step with the executor's spans on, and the time it is blocked in
        communication: synchronous all-reduces, waits for (prefetched)
        all-gathers, for the gradient buckets (the STEP's; at zero 2 and 3
        also each micro-batch's reduce-scatters'), for the count of targets
        (started first in the forward) and for the loss (at the step's end)."""
        comm: list[Span] = []
        calls = {"all_reduce": partial(timed_call, "all_reduce (synchronous)", comm),
                 "all_gather_many_async": partial(timed_wait, "all_gather wait", comm),
                 "all_reduce_async": partial(timed_wait, _ASYNC_WAITS, comm)}
        with patched(self.ex.comm, calls):
            wall, spans = profiled_step(self.ex, self.state, split_microbatches(b, M))
        return wall, spans, comm

    def reset_peak(self) -> None:
        self.ex.mem.peak = self.ex.mem.live

    def memory(self) -> dict:
        """The executor's own live-bytes peak, and the plan's by category."""
        return {"executor_peak": self.ex.mem.peak, "planned": dict(self.ex.plan.memory.peak)}


class TorchTrainer:
    """DDP or FSDP2 over the GPT, gradient accumulation as meshplan's."""

    def __init__(self, kind: str, rank: int):
        torch.manual_seed(0)
        model = build_model(cfg())
        self.kind, self.rank, self.spans = kind, rank, None
        if kind == "ddp":
            self.model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            self.model = fully_shard(model)
        self.opt = torch_optimizer(OptimizerConfig.default("adamw"), self.model)

    def step(self, b) -> float:
        """One step; this rank's mean loss over its micro-batches."""
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for i, mb in enumerate(split_microbatches(b, M)):
            tokens, targets = (t.chunk(DP)[self.rank] for t in mb)
            with self._sync(i == M - 1):
                with self._span("forward"):
                    loss = self.model(tokens, targets)
                with self._span("backward"):
                    (loss / M).backward()
            total += float(loss.detach())
        with self._span("optimizer"):
            self.opt.step()
        return total / M

    def _sync(self, last: bool):
        """Reduce the gradients in the last micro-batch's backward only."""
        if self.kind == "ddp":
            return contextlib.nullcontext() if last else self.model.no_sync()
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _span(self, name: str):
        t0 = time.perf_counter()
        yield
        if self.spans is not None:
            self.spans.append(Span(name, Track.COMPUTE, t0, time.perf_counter()))

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        slots = [t for p in params for t in self.opt.state.get(p, {}).values()
                 if torch.is_tensor(t)]
        return {"param": [local(p) for p in params],
                "grad": [local(p.grad) for p in params if p.grad is not None],
                "optimizer": [local(t) for t in slots]}

    def profiled(self, b) -> tuple[float, list[Span], list[Span]]:
        """A step with its phases' spans on, and for FSDP2 the time in its
        parameter groups' calls that communicate: `unshard` (the all-gather;
        on gloo it runs inside), `wait_for_unshard` (its wait and copy-out),
        `post_backward` (the reduce-scatter in the last micro-batch, the
        reshard). DDP's reducer communicates in C++, out of reach."""
        self.spans, comm = [], []
        calls = {n: partial(timed_call, n, comm) for n in _FSDP_COMM} \
            if self.kind == "fsdp2" else {}
        t0 = time.perf_counter()
        try:
            with patched(fsdp_param_group(), calls):
                self.step(b)
        finally:
            spans, self.spans = self.spans, None
        return time.perf_counter() - t0, spans, comm

    def reset_peak(self) -> None:
        pass

    def memory(self) -> dict:
        return {}


_FSDP_COMM = ("unshard", "wait_for_unshard", "post_backward")


def fsdp_param_group():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    return FSDPParamGroup


# ------------------------------------------------------------------ profile timers
@contextlib.contextmanager
def patched(owner, wrappers: dict):
    """Diagnostic, for profiled steps only: each attribute `name` of `owner`
    replaced by `wrappers[name](original)`, and restored after."""
    saved = {name: getattr(owner, name) for name in wrappers}
    for name, wrap in wrappers.items():
        setattr(owner, name, wrap(saved[name]))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(owner, name, fn)


def _timed(name: str, spans: list[Span], fn, *args, **kwargs):
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        spans.append(Span(name, Track.COMM, t0, time.perf_counter()))


def timed_call(name: str, spans: list[Span], fn):
    """`fn` with each call appended to `spans` as a COMM span `name` (a
    function, so that on a class it binds as a method)."""
    def call(*args, **kwargs):
        return _timed(name, spans, fn, *args, **kwargs)
    return call


class _Waited:
    """What a communication call returned, with its wait (`wait()`, or
    calling it) timed as a COMM span."""

    def __init__(self, name: str, spans: list[Span], inner):
        self.name, self.spans, self.inner = name, spans, inner

    def wait(self):
        return _timed(self.name, self.spans, self.inner.wait)

    def __call__(self, *args):
        return _timed(self.name, self.spans, self.inner, *args)


def timed_wait(name, spans: list[Span], fn):
    """`fn` (a communication start) with the wait for its result timed;
    `name` a label, or a map from the call's `name` argument to labels."""
    def start(*args, **kwargs):
        label = name if isinstance(name, str) else name[kwargs.get("name", "bucket")]
        return _Waited(label, spans, fn(*args, **kwargs))
    return start


# meshplan's background all-reduces, by the `name` they are started with
_ASYNC_WAITS = {"bucket": "gradient bucket wait", "early": "count of targets wait",
                "deferred": "loss wait"}


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t.detach()


def trainer(name: str, rank: int, job_path: str):
    if name.startswith("meshplan"):
        return MeshplanTrainer(job_path, rank)
    return TorchTrainer(name, rank)


# ------------------------------------------------------------------ flight recorder
_ELEMENT = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4,
            "Short": 2, "Char": 1, "Byte": 1, "Bool": 1}


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def flight_records() -> list[dict]:
    """This process's collectives so far (the flight recorder's ring)."""
    from torch._C._distributed_c10d import _dump_fr_trace_json

    return json.loads(_dump_fr_trace_json(True, True))["entries"]


def last_step(records: list[dict]) -> list[dict]:
    """The collectives between the last two barriers: the last timed step's."""
    marks = [i for i, e in enumerate(records) if e["profiling_name"] == "gloo:barrier"]
    return records[marks[-2] + 1:marks[-1]]


def comm_summary(records: list[dict]) -> dict:
    """Per collective kind: count, bytes (the larger of input and output) and
    ring bytes (what a ring algorithm sends per rank)."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0, "ring_bytes": 0.0})
    for e in records:
        size = _ELEMENT[e["input_dtypes"][0]]
        n = max(sum(_prod(s) for s in e[k]) for k in ("input_sizes", "output_sizes")) * size
        kind = e["profiling_name"].removeprefix("gloo:")
        out[kind]["count"] += 1
        out[kind]["bytes"] += n
        out[kind]["ring_bytes"] += n * (DP - 1) / DP * (2 if kind == "all_reduce" else 1)
    return dict(out)


# ------------------------------------------------------------------ rank processes
def _account(name: str, rank: int, job_path: str) -> dict:
    """WARMUP + 1 steps, live storages counted from before the model is
    built; of the last (DDP rebuilds its buckets in the second): its
    collectives, its live peak (and meshplan's executor's); then the state
    at rest."""
    with LiveStorages() as live:
        t = trainer(name, rank, job_path)
        *warm, last = batches(0, WARMUP + 1)
        timed_steps(t.step, warm, CPU)
        live.reset_peak()
        t.reset_peak()
        timed_steps(t.step, [last], CPU)
    return {"comm": comm_summary(last_step(flight_records())),
            "at_rest": at_rest(t.state_tensors()),
            "memory": {"live_peak": live.peak, **t.memory()}}


def _profile(name: str, rank: int, job_path: str) -> dict:
    """Mean seconds per step, per phase and in communication spans, over
    PROFILE_STEPS steps after the warm-up."""
    t = trainer(name, rank, job_path)
    timed_steps(t.step, batches(0, WARMUP), CPU)
    runs = []
    for b in batches(WARMUP, PROFILE_STEPS):
        dist.barrier()
        runs.append(t.profiled(b))
    return {"step_s": sum(r[0] for r in runs) / len(runs),
            "phases_s": phase_seconds([(w, s) for w, s, _ in runs]),
            "comm_s": comm_kinds([s for _, _, ss in runs for s in ss], len(runs))}


def _rank(rank: int, port: int, out: str, name: str, job_path: str, mode: str,
          steps: int) -> None:
    join_group(rank, port, DP)
    if mode == "account":
        result = _account(name, rank, job_path)
    elif mode == "profile":
        result = _profile(name, rank, job_path)
    else:
        t, cpu = trainer(name, rank, job_path), []

        def step(b):  # and its CPU seconds: the whole process's, and this (main) thread's
            p0, m0 = time.process_time(), time.thread_time()
            loss = t.step(b)
            cpu.append((time.process_time() - p0, time.thread_time() - m0))
            return loss
        losses, times = timed_steps(step, batches(0, steps), CPU)
        result = {"losses": losses, "step_s": times, "cpu_s": cpu}
    write_rank(out, rank, result)
    dist.destroy_process_group()


def run_config(name: str, job_path: str, mode: str = "timed", steps: int = 0) -> list[dict]:
    """`name` on DP rank processes; every rank's result, in rank order.
    `mode`: "timed" (`steps` steps), "account" (`_account`: the flight
    recorder on; it costs time, so only here) or "profile" (`_profile`)."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(FR_ENTRIES if mode == "account" else 0)
    return spawn_ranks(_rank, (name, job_path, mode, steps), DP)


def plan_jobs(folder: str) -> dict[str, str]:
    """Each meshplan configuration's Job, planned once, as a file the ranks read."""
    paths = {}
    for z in ZEROS:
        s = zoo_strategy("gpt", cfg(), dp=DP, zero=z, global_batch_size=BATCH,
                         micro_batch_size=MICRO)
        job = plan_model("gpt", "small", Mesh(1, DP), s, "adamw").job
        paths[f"meshplan_zero{z}"] = path = str(Path(folder, f"zero{z}.bin"))
        write_atomic(Path(path), job.to_bytes())
    return paths


# ------------------------------------------------------------------ rounds
CONFIGS = {"ddp": "torch DDP (25 MB buckets)",
           "meshplan_zero0": "meshplan zero 0 (buckets 25 MiB)",
           "meshplan_zero1": "meshplan zero 1 (buckets 25 MiB)",
           "meshplan_zero2": "meshplan zero 2 (buckets 25 MiB)",
           "meshplan_zero3": "meshplan zero 3 (buckets 25 MiB)",
           "fsdp2": "torch FSDP2 (fully_shard per block and root)"}
PAIRS = {"zero3_vs_fsdp2": ("meshplan_zero3", "fsdp2"), "zero0_vs_ddp": ("meshplan_zero0", "ddp")}


def once_each(jobs: dict[str, str], names, mode: str) -> dict[str, list[dict]]:
    """Each of `names` once in `mode`, after the CPUs are quiet."""
    out = {}
    for name in names:
        wait_quiet()
        out[name] = run_config(name, jobs.get(name, ""), mode)
    return out


def measure(jobs: dict[str, str], steps: int, rounds: int) -> dict[str, dict]:
    """Every configuration once per round (`common.alternate`): per round,
    the step times (max over ranks) and the losses (mean over ranks)."""
    runs = alternate({k: lambda k=k: run_config(k, jobs.get(k, ""), "timed", steps)
                      for k in CONFIGS}, rounds)
    return {k: {"step_s": [[max(r["step_s"][i] for r in ranks) for i in range(steps)]
                           for ranks in v["rounds"]],
                "cpu_s": [[[sum(r["cpu_s"][i][j] for r in ranks) for i in range(steps)]
                           for ranks in v["rounds"]] for j in (0, 1)],
                "losses": [[sum(r["losses"][i] for r in ranks) / DP for i in range(steps)]
                           for ranks in v["rounds"]],
                "busy_before": v["busy_before"]}
            for k, v in runs.items()}


# ------------------------------------------------------------------ targets
def shard_target(acct: dict, category: str, zeros: tuple[int, ...]) -> dict:
    """Per zero level in `zeros` and rank: `category`'s bytes at rest against
    zero 0's / DP; met when every one is within zero 0's padding allowance."""
    base = acct["meshplan_zero0"]
    per = {z: [{"bytes": r["at_rest"]["bytes"][category],
                "ideal": b["at_rest"]["bytes"][category] / DP,
                "pad": b["at_rest"]["pad"][category]}
               for r, b in zip(acct[f"meshplan_zero{z}"], base, strict=True)]
           for z in zeros}
    met = all(abs(x["bytes"] - x["ideal"]) <= x["pad"] for xs in per.values() for x in xs)
    return {"per_zero": per, "met": met}


def loss_check(runs: dict) -> dict:
    """Every configuration's losses (round 0) against DDP's, relative."""
    ref = runs["ddp"]["losses"][0]
    rel = {k: max(abs(x - y) / abs(y) for x, y in zip(v["losses"][0], ref, strict=True))
           for k, v in runs.items()}
    return {"per_step": {k: v["losses"][0] for k, v in runs.items()}, "reference": "ddp",
            "max_rel_diff": rel, "tolerance": LOSS_RTOL,
            "met": max(rel.values()) <= LOSS_RTOL}


def targets(acct: dict, t: dict, loss: dict) -> dict:
    ratio = {k: t[a] / t[b] for k, (a, b) in PAIRS.items()}
    return {"optimizer_1_over_dp": shard_target(acct, "optimizer", (1, 2, 3)),
            "param_1_over_dp_zero3": shard_target(acct, "param", (3,)),
            **{k: {"ratio": r, "target": TARGETS[k], "met": r <= TARGETS[k]}
               for k, r in ratio.items()},
            "losses_equal": {k: v for k, v in loss.items() if k != "per_step"}}


# ------------------------------------------------------------------ report
def per_rank(values: list, fmt) -> str:
    """One figure when every rank's is the same, else each rank's."""
    shown = [fmt(v) for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def mib(values: list[float]) -> str:
    return per_rank(values, lambda v: f"{v / MiB:.2f}")


def _comm_cells(ranks: list[dict]) -> list[str]:
    kinds = sorted({k for r in ranks for k in r["comm"]})
    count = ", ".join(per_rank([r["comm"][k]["count"] for r in ranks], str) + f" {k}"
                      for k in kinds)
    total = [sum(c["bytes"] for c in r["comm"].values()) for r in ranks]
    ring = [sum(c["ring_bytes"] for c in r["comm"].values()) for r in ranks]
    return [count, mib(total), mib(ring)]


def time_table(acct: dict, t: dict, best: dict, cpu: dict) -> list[str]:
    lines = ["| configuration | median step (ms) | best round's median (ms) | CPU a step, all "
             "ranks: process / main threads (ms) | collectives per step and rank | MiB per "
             "step and rank | ring MiB sent per step and rank |",
             "|---|---|---|---|---|---|---|"]
    for k, label in CONFIGS.items():
        cells = [label, f"{t[k] * 1e3:.0f}", f"{best[k] * 1e3:.0f}",
                 f"{cpu[k][0] * 1e3:.0f} / {cpu[k][1] * 1e3:.0f}", *_comm_cells(acct[k])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _planned(ranks: list[dict]) -> str:
    if "planned" not in ranks[0]["memory"]:
        return "-"
    keys = ("param", "grad", "optimizer", "activation", "temp")
    parts = " + ".join(mib([r["memory"]["planned"][k] for r in ranks]) for k in keys)
    return f"{parts} = {mib([r['memory']['planned']['total'] for r in ranks])}"


def memory_table(acct: dict) -> list[str]:
    lines = ["| configuration | param at rest | grad at rest | optimizer at rest | live peak "
             "(measured) | meshplan executor's peak | planned: param + grad + optimizer + "
             "activation + temp = total |", "|---|---|---|---|---|---|---|"]
    for k, label in CONFIGS.items():
        ranks = acct[k]
        rest = [mib([r["at_rest"]["bytes"][c] for r in ranks]) for c in CATEGORIES]
        ex = ([mib([r["memory"]["executor_peak"] for r in ranks])]
              if "executor_peak" in ranks[0]["memory"] else ["-"])
        cells = [label, *rest, mib([r["memory"]["live_peak"] for r in ranks]), *ex,
                 _planned(ranks)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def target_lines(tg: dict, best_ratio: dict) -> list[str]:
    opt, par = tg["optimizer_1_over_dp"], tg["param_1_over_dp_zero3"]
    lines = []
    for name, x, what in (("optimizer-state", opt, "zero >= 1"), ("parameter", par, "zero 3")):
        worst = max((abs(r["bytes"] - r["ideal"]), z, i, r) for z, rs in x["per_zero"].items()
                    for i, r in enumerate(rs))
        d, z, i, r = worst
        lines.append(f"- {name} bytes per rank at {what} = 1/dp of zero 0's within padding: "
                     f"{_met(x['met'])} (largest gap: zero {z} rank {i}, {r['bytes']} B vs "
                     f"{r['ideal']:.0f} B, {d:.0f} B off; allowance {r['pad']} B)")
    for k, (a, b) in PAIRS.items():
        x = tg[k]
        lines.append(f"- {CONFIGS[a]} / {CONFIGS[b]} median step = {x['ratio']:.3f} (target "
                     f"<= {x['target']}): {_met(x['met'])} (best rounds: {best_ratio[k]:.3f})")
    loss = tg["losses_equal"]
    worst = max(loss["max_rel_diff"].items(), key=lambda kv: kv[1])
    lines.append(f"- losses equal DDP's within {loss['tolerance']:.0e} relative: "
                 f"{_met(loss['met'])} (largest: {worst[0]}, {worst[1]:.1e})")
    return lines


def _mean(ranks: list[dict], key: str) -> dict[str, float]:
    """A profile's `key` (seconds per step by name), the mean over ranks."""
    names = dict.fromkeys(n for r in ranks for n in r[key])
    return {n: sum(r[key].get(n, 0.0) for r in ranks) / len(ranks) for n in names}


def profile_lines(prof: dict, acct: dict) -> list[str]:
    """Where a step's time goes in each profiled configuration (mean over
    ranks; every rank's in the JSON)."""
    lines = []
    for name, ranks in prof.items():
        counts = ", ".join(f"{c['count']} {k}" for k, c in acct[name][0]["comm"].items())
        step = sum(r["step_s"] for r in ranks) / len(ranks)
        phases = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in _mean(ranks, "phases_s").items()
                           if v >= 5e-4)
        comm = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in _mean(ranks, "comm_s").items())
        lines.append(f"- {CONFIGS[name]} ({counts} a step): {step * 1e3:.0f} ms = {phases}; "
                     f"blocked in communication: {comm or 'not timed'}.")
    return lines


# ------------------------------------------------------------------ the picture
# span kind -> (lane offset from the rank's row, colour, legend)
LANES = {"compute": (-0.46, "#BBBBBB", "action: F forward, B backward (micro-batch), STEP"),
         "all_gather": (-0.23, "#0072B2", "all-gather of a layer, from its start to its "
                        "wait's end (prefetched a layer ahead)"),
         "all_reduce": (0.0, "#009E73", "gradient bucket: the reduce-scatters as one flat "
                        "all-reduce, from its start to its wait's end"),
         "small": (0.23, "#D55E00", "all-reduce in the background, from its start to its "
                   "wait's end: the count of targets, the loss (waited at the step's end)"),
         "all_reduce(sum)": (0.23, "#CC79A7", "all-reduce, synchronous")}
LANE_HEIGHT = 0.21


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length covered by at least one of `intervals` (they may overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def traced_zero3(path: str) -> dict:
    """meshplan zero 3 for 2 steps through `run`, its last step traced to
    `path` (a Chrome trace: compute and collectives per rank)."""
    from meshplan.driver.run import run

    s = zoo_strategy("gpt", cfg(), dp=DP, zero=3, global_batch_size=BATCH,
                     micro_batch_size=MICRO)
    os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
    return run("gpt", "small", Mesh(1, DP), s, steps=2, optimizer="adamw", threads=1,
               trace=path)["trace"]


def _lane(e: dict) -> str:
    if e["cat"] == "compute":
        return "compute"
    kind, _, rest = e["name"].partition(" ")
    return "small" if kind == "all_reduce" and rest.startswith(("early", "deferred")) else kind


def draw_step(trace: dict, png: str) -> None:
    """One row per rank, four lanes: its actions (labelled), its all-gathers
    and gradient buckets (translucent: several are in flight at once) and its
    synchronous all-reduces, in ms
    from the barrier before the step; the title sums up rank 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and _lane(e) in LANES]
    fig, ax = plt.subplots(figsize=(12, 4.2))
    for e in spans:
        x, w = e["ts"] / 1e3, e["dur"] / 1e3
        offset, colour, _ = LANES[_lane(e)]
        alpha = 0.35 if _lane(e) in ("all_gather", "all_reduce", "small") else 1.0
        ax.broken_barh([(x, w)], (e["pid"] + offset, LANE_HEIGHT), color=colour, alpha=alpha,
                       edgecolor="white" if _lane(e) == "compute" else "none")
        if _lane(e) == "compute":
            ax.text(x + w / 2, e["pid"] + offset + LANE_HEIGHT / 2,
                    e["name"].lstrip("0123456789"), ha="center", va="center", fontsize=7)
    ranks = sorted({e["pid"] for e in spans})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the barrier before the step")
    ax.set_title(f"meshplan zero 3, GPT small, dp={DP}, {M} micro-batches, gloo on CPU: one "
                 f"measured step.\nRank 0: {_summary(spans)}", fontsize=9)
    drawn = {_lane(e) for e in spans}
    handles = [Patch(color=c, label=label) for k, (_, c, label) in LANES.items() if k in drawn]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2,
              fontsize=8, frameon=False)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _summary(spans: list[dict]) -> str:
    """Rank 0's step, and how many of each collective, open for how long."""
    mine = [e for e in spans if e["pid"] == 0]
    step = max(e["ts"] + e["dur"] for e in mine) / 1e3
    parts = []
    for kind, word in (("all_gather", "all-gathers"), ("all_reduce", "buckets"),
                       ("small", "all-reduces of the count and the loss"),
                       ("all_reduce(sum)", "synchronous all-reduces")):
        ss = [(e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in mine if _lane(e) == kind]
        parts.append(f"{len(ss)} {word}, open {covered(ss):.0f} ms")
    return f"{step:.0f} ms step; " + ", ".join(parts)


def picture(png: str) -> dict:
    """Trace meshplan zero 3 and draw its step; returns the trace's summary."""
    with tempfile.TemporaryDirectory(prefix="sharded-dp-trace-") as d:
        path = str(Path(d, "trace.json"))
        summary = traced_zero3(path)
        draw_step(json.loads(Path(path).read_text()), png)
    return {"png": png, "step_s": summary["step_s"]}


# ------------------------------------------------------------------ main
def report(a, acct: dict, runs: dict, prof: dict, load: list[float]) -> tuple[dict, str]:
    t = {k: timed_median(v["step_s"]) for k, v in runs.items()}
    best = {k: best_round(v["step_s"]) for k, v in runs.items()}
    cpu = {k: [timed_median(c) for c in v["cpu_s"]] for k, v in runs.items()}
    loss = loss_check(runs)
    tg = targets(acct, t, loss)
    best_ratio = {k: best[x] / best[y] for k, (x, y) in PAIRS.items()}
    head = (f"Sharded data parallel: GPT small (8 layers, hidden 256, seq 128, vocab 1024, "
            f"6.9M parameters), dp={DP} on {DP} gloo processes, 1 thread each, CPU, AdamW; "
            f"global batch {BATCH} = {M} micro-batches x {MICRO} x {DP} ranks. Step times: "
            f"median of {a.rounds} rounds x {a.steps - WARMUP} steps (each after {WARMUP} "
            "warm-up), configurations alternating by round, each started once the CPUs were "
            f"quiet (or after 10 s); load average before/after {load[0]:.1f}/{load[1]:.1f} on "
            f"{machine()['cpu_count']} CPUs. Collectives and bytes: c10d's flight recorder, "
            "one step. Memory in MiB per rank (one figure where all ranks agree).")
    lines = [head, "", *time_table(acct, t, best, cpu), "", *memory_table(acct), "",
             *target_lines(tg, best_ratio)]
    if prof:
        lines += ["", "Where the time goes (one profiled run each, after the rounds):", "",
                  *profile_lines(prof, acct)]
    result = {"benchmark": "sharded_dp", "machine": machine(), "model": "gpt small",
              "dp": DP, "global_batch": BATCH, "micro_batch": MICRO, "microbatches": M,
              "optimizer": "adamw", "warmup_steps": WARMUP, "steps": a.steps,
              "rounds": a.rounds, "median_step_s": t, "best_round_step_s": best,
              "median_cpu_s": cpu,
              "step_s": {k: v["step_s"] for k, v in runs.items()},
              "cpu_s": {k: v["cpu_s"] for k, v in runs.items()},
              "cpu_busy_before": {k: v["busy_before"] for k, v in runs.items()},
              "per_rank": acct, "targets": tg, "losses": loss, "profile": prof,
              "load_average_before_after": load}
    return result, "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per configuration "
                    f"per round, the first {WARMUP} untimed")
    ap.add_argument("--rounds", type=int, default=5, help="0: only --picture")
    ap.add_argument("--picture", default="", help="also draw one measured meshplan zero-3 "
                    "step's collectives per rank into this PNG")
    a = ap.parse_args()
    if a.rounds > 0:
        load = [os.getloadavg()[0]]
        with tempfile.TemporaryDirectory(prefix="sharded-dp-jobs-") as folder:
            jobs = plan_jobs(folder)
            acct = once_each(jobs, CONFIGS, "account")
            runs = measure(jobs, a.steps, a.rounds)
            t = {k: timed_median(v["step_s"]) for k, v in runs.items()}
            missed = [n for k, (x, y) in PAIRS.items() if t[x] / t[y] > TARGETS[k]
                      for n in (x, y)]
            prof = once_each(jobs, missed, "profile")
        load.append(os.getloadavg()[0])
        result, table = report(a, acct, runs, prof, load)
        write("sharded_dp", result, table)
        assert result["losses"]["met"], f"losses differ: {result['losses']['max_rel_diff']}"
    if a.picture:
        print(picture(a.picture))


if __name__ == "__main__":
    main()
