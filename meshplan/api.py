"""The public Python API: six verbs over any `nn.Module`
(`import meshplan.api as mp`).

    graph = capture(module, one_microbatch)          # torch.export -> Graph
    job   = plan(graph, mesh, strategy)              # train step, SBP, stages -> Job
    stats = compile(job, "plans/")                   # one RankPlan file per rank
    res   = check("plans/")                          # consistent? bubble, peaks
    out   = run(job, module, batches)                # one local process per rank
    out   = verify(job, module, batches)             # run, beside eager PyTorch
    res   = train(job, module, data, out="run/")     # a run: metrics, eval, trained weights
    best  = search("gpt", "small", mesh, 16, "a100-80gb")  # the fastest strategy that fits

Invariants:
- Each function is a thin, documented entry over the layer that does the
  work (capture/export.py, passes/plan.py (the passes), driver/compile.py,
  lowering/check.py, driver/run.py, driver/reference.py); none adds behaviour
  of its own besides argument checks.
- `run` and `verify` start the ranks from a fork server: call them under
  `if __name__ == "__main__":`. The ranks get the module's weights and the
  batches as tensors (`weights_only` loads), never the pickled module.
- A user mistake raises a `ConfigError` that says what to change.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.costmodel import load_device_model
from meshplan.data.feed import TokenFeed
from meshplan.driver.capture_check import checked_capture
from meshplan.driver.compile import compile_job
from meshplan.driver.init_from import weight_source
from meshplan.driver.model_record import model_record
from meshplan.driver.results import VerifyResult
from meshplan.driver.run import launch, run_devices
from meshplan.driver.train import train_job
from meshplan.driver.verify import against_eager
from meshplan.errors import ConfigError
from meshplan.ir import Role
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.lowering.check import check_plans
from meshplan.lowering.check_classes import check_dir
from meshplan.models.hf import HFLoss
from meshplan.passes.plan import PASSES, Compilation, plan_forward
from meshplan.passes.strategy import check_strategy
from meshplan.runtime.devices import resolve_device
from meshplan.runtime.state import weights_of
from meshplan.runtime.worker import RunSpec
from meshplan.search.graph_search import searched_strategy
from meshplan.search.probe import ModelSpec
from meshplan.search.search import search as _search

if TYPE_CHECKING:
    from meshplan.driver.results import LowerResult, RunResult

__all__ = ["Mesh", "OptimizerConfig", "Strategy", "TokenFeed", "capture", "check", "compile",
           "plan", "plan_eval", "run", "search", "train", "verify"]


def capture(module, inputs: tuple, loss_fn=None, targets: tuple = (), self_check: bool = True,
            precision: str = "fp32"):
    """Capture `module` called on `inputs` (one micro-batch: micro_batch_size x
    dp samples) as a forward `Graph` ending in a scalar loss.

    A module that returns its loss needs no `loss_fn`; otherwise the loss is
    `loss_fn(module(*inputs), *targets)`. On real inputs and weights the
    captured forward is run once and compared with the module's own
    (`self_check=False` skips it): a `CaptureError` names the first op that
    differs. `precision` is the strategy's ("fp32", "bf16", "fp16"): a
    model's own casts (`x.to(input_dtype)`) resolve as under autocast in it,
    and `plan` takes the graph only with that precision."""
    return checked_capture(module, tuple(inputs), loss_fn, tuple(targets), self_check,
                           precision)


def plan(graph, mesh, strategy, optimizer="sgd", lr: float | None = None,
         device_model: str = "cpu-local", memory_per_device: int | None = None):
    """The `Job` of `graph` (from `capture`) on `mesh` under `strategy`: the
    whole train step (forward, backward, accumulation over the strategy's
    micro-batches, the optimizer), laid out in SBP, boxed and staged.

    `optimizer` is "sgd", "adamw" or an `OptimizerConfig`; `lr` overrides
    its learning rate.

    With `Strategy(auto=True, global_batch_size=G, ...)` the strategy is
    searched first (`--auto`'s search, on `device_model` within
    `memory_per_device` bytes, its winner proven by its full plan): dp, tp,
    pp, vpp, schedule, recompute and ZeRO, with dp x micro-batch size the
    batch `graph` was captured with; the strategy's other fields (precision,
    buckets, layer pattern, tp plan) are kept. The Job's strategy is the
    winner."""

    opt = OptimizerConfig.of(optimizer, lr)
    if strategy.auto:

        strategy = searched_strategy(graph, mesh, strategy, opt, device_model,
                                     memory_per_device)
    strategy = check_strategy(mesh, strategy)
    want = strategy.micro_batch_size * strategy.dp
    for v in graph.inputs_by_role(Role.DATA):
        if v.meta.shape and v.meta.shape[0] != want:
            raise ConfigError(
                f"input '{v.name}' was captured with batch {v.meta.shape[0]}, but one "
                f"micro-batch is micro_batch_size {strategy.micro_batch_size} x dp "
                f"{strategy.dp} = {want} samples; capture on a batch of {want}")
    return PASSES.run(Compilation(graph, mesh, strategy, opt)).job


def search(model: str, size: str, mesh, global_batch_size: int, device_model: str,
           memory_per_device: int | None = None, precision: str = "fp32",
           optimizer: str = "adamw", top: int = 10, **overrides):
    """The strategy search (`meshplan plan --auto`) for a zoo or transformers
    model (`"hf:gpt2"`): the `top` strategies by simulated step on
    `device_model` ("a100-80gb", ..., "cpu-local") within `memory_per_device`
    bytes (default: the device's), each `Ranked(cand, pred)`, and
    `.strategy(i)`: candidate i as a `Strategy` to `plan` with. It rebuilds
    the model with fewer layers to price one layer, so it takes the model's
    name, not a captured graph."""
    spec = ModelSpec(model, size, tuple(sorted(overrides.items())), optimizer, precision)
    return _search(spec, mesh, global_batch_size, load_device_model(device_model),
                   memory_limit=memory_per_device, top=top)


def compile(job, out: str | Path, ranks: Sequence[int] | None = None,
            workers: int | None = None, progress=None, device: str = "cpu") -> LowerResult:
    """Write `out/job.json` and one plan file per rank (default: all ranks),
    each rank lowered in a worker process for `device` (cpu | cuda: it picks
    each task's kernel; no GPU needed); returns timings per rank.
    `progress(done, total)` is called as ranks finish."""
    return compile_job(job, out, None if ranks is None else list(ranks), workers,
                       progress=progress, device=device)


def check(plans: str | Path | tuple):
    """Prove a plan directory (or a `(job, {rank: RankPlan})` pair) consistent:
    unique ids, matched send/recv, ordered collectives, a deadlock-free
    simulated step. Returns a `CheckResult` (`ok`, `errors`, `bubble_ratio`,
    `predicted_step_s`, per-rank peaks); never raises for a bad plan. Given
    only some ranks' plans it is `partial`, with the `missing` ranks and the
    proofs `skipped` for want of them."""
    if isinstance(plans, tuple):
        return check_plans(*plans)
    return check_dir(Path(plans))[1]


def run(job, module, batches: Sequence[tuple], plan_dir: str = "", trace: str = "",
        timeout_s: float = 60.0, threads: int = 1, report_state: bool = False,
        device: str = "cpu", backend: str = "") -> RunResult:
    """Train `module` (its current weights) for `len(batches)` steps on
    `job.mesh.world` local gloo processes, one per rank; `batches[k]` is the
    global batch of step k (a tuple like the captured inputs, with
    global_batch_size samples). The module itself is not changed.

    `device` is cpu, cuda or auto (cuda where available); `backend` gloo or
    nccl ("": nccl on cuda, gloo on cpu; gloo on cuda shares GPUs between
    ranks through host memory, for testing, not speed).

    Returns `losses` (mean over the global batch, per step), `step_s`, memory
    per rank, and with `trace` (a path) the measured last step there; with
    `report_state`, every rank's final state slices ("state_slices")."""
    batches = _checked(job, batches)
    device, backend = run_devices(device, backend, job.mesh.world)
    spec = RunSpec(len(batches), "", threads, timeout_s,
                   plan_dir=str(plan_dir), trace=bool(trace), report_state=report_state,
                   device=device, backend=backend)
    return launch(job, spec, time.perf_counter(), trace,
                  saved={"weights": weights_of(module), "batches": list(batches)})


def verify(job, module, batches: Sequence[tuple], bounds=None,
           **run_options) -> VerifyResult:
    """`run`, then the same steps with eager PyTorch on one process from the
    same weights (micro-batches and optimizer alike), on the same device
    (`run_options["device"]`); returns both loss curves, every parameter's
    and optimizer slot's difference after the last step (`params`,
    `optimizer_state`), and the verdict `ok` with its `problems`
    (`driver/compare.py`; `bounds` defaults to the Job's precision's)."""
    device = resolve_device(run_options.get("device", "cpu"))
    mine = run(job, module, batches, report_state=True, **(run_options | {"device": device}))
    s = job.strategy
    verdict, ref = against_eager(mine.rank_losses, mine.state_slices, module,
                                 list(batches), s.num_microbatches, OptimizerConfig.of_job(job),
                                 s.precision, s.initial_loss_scale, bounds, device,
                                 mine.rank_grad_norms)
    rest = {k: v for k, v in mine.to_json().items() if k not in ("losses", "rank_losses")}
    return VerifyResult.of(verdict, mine.losses, ref.losses, mine.rank_losses, **rest,
                           ref_grad_norms=ref.grad_norms)


def plan_eval(graph, job):
    """The forward-only Job of `graph` (from `capture`) for evaluating
    `job`'s model: no backward, no optimizer, laid out as `job` is (its
    mesh and strategy), so an evaluating rank reads the weights in place."""
    return plan_forward(graph, job.mesh, job.strategy)


def train(job, module, data, steps: int | None = None, out: str | Path = "meshplan-train",
          eval_job=None, eval_data: TokenFeed | None = None, eval_every: int = 0,
          eval_batches: int = 0, checkpoint_every: int = 0, keep: int = 0,
          async_checkpoint: bool = False, resume_from: str = "", load: bool = True,
          timeout_s: float = 300.0,
          stall_s: float = 300.0, threads: int = 1, device: str = "cpu", backend: str = "",
          tensorboard: bool | None = None, on_step=None, init_from: str = "",
          max_restarts: int = 0):
    """Train `module` (from its current weights) on `job.mesh.world` local
    processes, one per rank, and give the trained weights back.

    `data` is a `TokenFeed` (a split of a `meshplan prepare-data` directory:
    each rank reads only its own rows; `steps` required) or a list of global
    batches, one per step. With `eval_job` (`plan_eval`) and `eval_data`,
    the validation loss is computed before the first step and every
    `eval_every` steps. Metrics stream to `out/metrics.jsonl` (and TensorBoard
    when installed). With `checkpoint_every` the ranks save
    `out/checkpoints/step_<k>` (the newest `keep` complete ones kept; 0:
    all), in the background with `async_checkpoint`; `resume_from` (a
    complete checkpoint of any layout) continues a run; `max_restarts`
    restarts a run whose rank failed from its newest complete checkpoint.
    `init_from` (a save_pretrained directory, a state dict or a checkpoint)
    is read for the starting weights instead of `module`'s, each rank
    reading its own slices. Returns a `TrainResult` (`losses`, `evals`,
    `metrics`, `weights`: FQN -> full tensor); with `load` (the default) the
    trained weights are also copied into `module`, else `module` is left as
    it was."""
    if isinstance(data, TokenFeed):
        if steps is None or steps < 1:
            raise ConfigError("train on a TokenFeed needs steps=N (N >= 1)")
    else:
        data = _checked(job, data)
        steps = len(data) if steps is None else steps
        if steps > len(data):
            raise ConfigError(f"steps={steps} but {len(data)} batches were given; give one "
                              "global batch per step")
        data = data[:steps]
    if eval_job is not None and (eval_data is None or eval_every < 1 or eval_batches < 1):
        raise ConfigError("evaluation needs eval_data (a TokenFeed of the validation split), "
                          "eval_every >= 1 and eval_batches >= 1")
    device, backend = run_devices(device, backend, job.mesh.world)
    if init_from:

        init_from = weight_source(init_from, job, "model." if isinstance(module, HFLoss) else "")
    res = train_job(job, weights_of(module), data, steps, str(out), eval_job=eval_job,
                    eval_data=eval_data, eval_every=eval_every, eval_batches=eval_batches,
                    checkpoint_every=checkpoint_every, keep=keep,
                    async_checkpoint=async_checkpoint, resume_from=resume_from,
                    threads=threads, timeout_s=timeout_s, stall_s=stall_s, device=device,
                    backend=backend, tensorboard=tensorboard, on_step=on_step,
                    record=model_record(job, module, "module",
                                        data.data_dir if isinstance(data, TokenFeed) else ""),
                    init_from=init_from, max_restarts=max_restarts)
    if load:

        with torch.no_grad():
            for name, t in weights_of(module).items():
                t.copy_(res.weights[name])
    return res


def _checked(job, batches: Sequence[tuple]) -> list[tuple]:
    batches = [tuple(b) for b in batches]
    if not batches:
        raise ConfigError("run needs at least one batch (one per training step)")
    gbs = job.strategy.global_batch_size
    for k, b in enumerate(batches):
        sizes = {t.shape[0] for t in b if getattr(t, "ndim", 0)}
        if sizes != {gbs}:
            raise ConfigError(f"batch {k} has {sorted(sizes)} samples but the strategy's "
                              f"global batch is {gbs}; give every step {gbs} samples")
    return batches
