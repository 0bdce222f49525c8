"""verify: train a zoo model with eager PyTorch and with meshplan, compare.

Invariants:
- Both runs start from the same weights (one module, deep-copied) and see
  the same batches.
- The verdict (`ok`) is `driver/compare.py`'s: every loss-holding rank's
  curve, and every parameter, buffer and optimizer slot after the last step
  (assembled from all ranks' slices, replicas checked equal), against the
  eager reference: eager fp32, or eager `torch.autocast` (+ GradScaler) for
  bf16/fp16, within the precision's `Bounds`. Eager fp32 is a second,
  informational judge of a mixed-precision run (`vs_fp32`).
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict

import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.capture import capture
from meshplan.driver.compare import (
    BOUNDS,
    Bounds,
    Flips,
    adam_flips,
    assemble,
    chaos,
    compare_losses,
    compare_norms,
    compare_state,
    gap_of,
    max_abs,
    spread_verdict,
    update_rel,
)
from meshplan.driver.executor import Executor
from meshplan.driver.reference import EagerRun, eager_state, eager_train, split_microbatches
from meshplan.driver.results import VerifyResult, steady_step_s
from meshplan.driver.run import run
from meshplan.driver.same_masks import SameMasks
from meshplan.errors import ConfigError
from meshplan.ir.choices import OptimizerKind, Precision, Recompute
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.ir.state_name import is_state
from meshplan.models import build_model, example_batch, model_config
from meshplan.ops.device_kernels import FALLBACKS, RAN
from meshplan.passes.plan import PASSES, Compilation
from meshplan.passes.strategy import check_strategy
from meshplan.runtime.amp import INIT_SCALE
from meshplan.runtime.checkpoint import box_key
from meshplan.runtime.devices import resolve_device
from meshplan.runtime.fused import check_kernels
from meshplan.runtime.rank_executor import NonFiniteNorm, halted


def verify(
    model: str = "gpt",
    size: str = "tiny",
    steps: int = 20,
    optimizer: str | OptimizerConfig = "sgd",
    global_batch_size: int = 8,
    num_microbatches: int = 1,
    seed: int = 0,
    mesh: Mesh | None = None,
    strategy: Strategy | None = None,
    lr: float | None = None,
    run_options: dict | None = None,
    bounds: Bounds | None = None,
    device: str = "cpu",
    reference_rng: str = "same",
    ref_runs: int = 5,
    **overrides,
) -> VerifyResult:
    """Train `steps` steps both ways; returns losses, per-tensor state
    differences, the verdict `ok` (with `problems`) and timings.

    With a `mesh` and `strategy`, meshplan compiles the Job and trains on one
    local process per rank (gloo); the eager reference sees the same global
    batches, split into the same micro-batches (of micro_batch_size x dp);
    `run_options` go to `driver.run.run` (plan_dir, trace, on_step, backend,
    ...). `device` (cpu | cuda | auto) is where both meshplan and the eager
    reference run. `bounds` defaults to the precision's (`compare.BOUNDS`).

    The reference's random ops (dropout, ...) draw meshplan's numbers
    (`reference_rng` "same", `same_masks.py`), so equality is judged as
    without them; with "torch" they draw from torch's own generator in
    `ref_runs` eager runs of other seeds, and the losses are judged against
    their spread (`compare.spread_verdict`), parameters not at all."""
    device = resolve_device(device)
    check_kernels((run_options or {}).get("kernels", "eager"), device)
    if strategy is not None:
        global_batch_size = strategy.global_batch_size
        num_microbatches = strategy.num_microbatches
    if steps < 1 or global_batch_size < 1 or num_microbatches < 1:
        raise ConfigError("steps, global batch size and micro-batch count must be >= 1")
    if global_batch_size % num_microbatches:
        raise ConfigError(f"global batch {global_batch_size} does not split into "
                          f"{num_microbatches} micro-batches; use a multiple of it")
    cfg = model_config(model, size, **overrides)
    torch.manual_seed(seed)
    module = build_model(cfg)
    reference = copy.deepcopy(module)
    fp32_reference = copy.deepcopy(module)
    precision = strategy.precision if strategy is not None else Precision.FP32
    init_scale = strategy.initial_loss_scale if strategy is not None else INIT_SCALE
    opt = OptimizerConfig.of(optimizer, lr)
    batches = [example_batch(cfg, global_batch_size, seed=seed + s) for s in range(steps)]
    if strategy is not None:  # a layout its mesh cannot hold is refused, as plan refuses it
        mesh = mesh or Mesh(1, strategy.dp * strategy.cp * strategy.tp * strategy.pp)
        strategy = check_strategy(mesh, strategy)
    if strategy is not None and (mesh.world > 1 or strategy.pp * strategy.vpp > 1
                                 or strategy.recompute != Recompute.NONE):
        result = run(model, size, mesh, strategy, steps, optimizer, seed, lr=lr,
                     report_state=True, device=device, **(run_options or {}), **overrides)
        mine = {"mode": "distributed", "losses": result.losses,
                "rank_losses": result.rank_losses, "slices": result.state_slices,
                "rank_grad_norms": result.rank_grad_norms,
                "trace": result.trace, "step_s": result.median_step_s,
                "ranks": result.ranks, "ops": None, "capture_s": None, "autodiff_s": None,
                "measured_peak_bytes": max(r["measured_peak_bytes"]
                                           for r in result.ranks.values())}
    else:
        mine = _single(module, batches, opt, num_microbatches, precision, init_scale, device,
                       (run_options or {}).get("kernels", "eager"))
    if reference_rng == "torch":
        return _against_spread(mine, reference, batches, num_microbatches, opt, precision,
                               init_scale, device, seed, ref_runs)
    # the second judge, for information: full-precision eager (and AdamW's quiet gradients)
    wide = eager_train(fp32_reference, batches, num_microbatches, opt, device=device,
                       masks=SameMasks(seed)) if precision != Precision.FP32 else None
    reset_peak(device)
    verdict, ref = against_eager(mine["rank_losses"], mine.pop("slices"), reference, batches,
                                 num_microbatches, opt, precision, init_scale, bounds, device,
                                 mine.get("rank_grad_norms"), seed, wide)
    ref_peak = peak_of(device)
    extra = {"precision": precision, "device": device, "ref_measured_peak_bytes": ref_peak}
    if wide is not None:
        fp32 = wide.losses
        extra |= {"ref_fp32_losses": fp32,
                  "vs_fp32": {"mean_rel_diff": mean_rel_diff(mine["losses"], fp32),
                              "autocast_mean_rel_diff": mean_rel_diff(ref.losses, fp32)}}
    losses, rank_losses = mine.pop("losses"), mine.pop("rank_losses")
    return VerifyResult.of(
        verdict, losses, ref.losses, rank_losses, **extra, model=model, size=size,
        config=asdict(cfg), steps=steps, optimizer=str(opt.kind),
        global_batch_size=global_batch_size, num_microbatches=num_microbatches, **mine,
        ref_step_s=steady_step_s(ref.step_s), ref_grad_norms=ref.grad_norms,
        grad_norms=next(iter((mine.get("rank_grad_norms") or {}).values()), []))


def _against_spread(mine: dict, module, batches, m: int, opt: OptimizerConfig,
                    precision: Precision, init_scale: float, device: str, seed: int,
                    runs: int) -> VerifyResult:
    """verify's statistical judgement (`reference_rng` "torch")."""
    curves, times = [], []
    for k in range(runs):
        torch.manual_seed(seed + 1 + k)  # the module's weights are built: the draws only
        run_k = eager_train(copy.deepcopy(module), batches, m, opt, precision, init_scale,
                            device)
        curves.append(run_k.losses)
        times.append(steady_step_s(run_k.step_s))
    verdict = spread_verdict(mine["rank_losses"], curves)
    mine.pop("slices")
    losses, rank_losses = mine.pop("losses"), mine.pop("rank_losses")
    return VerifyResult.of(verdict, losses, verdict["ref_mean"], rank_losses, **mine,
                           reference_rng="torch", ref_step_s=statistics.median(times),
                           ref_curves=curves)


def against_eager(rank_losses: dict[str, list[float]], slices: dict[int, dict], module,
                  batches: list[tuple], m: int, opt: OptimizerConfig,
                  precision: Precision = Precision.FP32,
                  init_scale: float = INIT_SCALE, bounds: Bounds | None = None,
                  device: str = "cpu", rank_grad_norms: dict | None = None,
                  seed: int | None = 0, wide: EagerRun | None = None):
    """Train `module` (its starting weights; not changed) eagerly on `batches`
    on `device`, and once more on `reordered` batches for the noise; returns
    (`judge`'s verdict on the run's losses and state slices, the reference
    `EagerRun`). The reference's random ops draw the run's numbers from
    `seed` (`same_masks.py`; the twin's follow its reversed samples), or with
    `seed` None torch's own (a statistical comparison only). `wide`, the
    same training in fp32 for a bf16/fp16 AdamW run (trained here if None):
    which gradients are mostly rounding (`compare.adam_flips`)."""
    def masks(flip: int = 0):
        return SameMasks(seed, flip) if seed is not None else None

    ref = eager_train(copy.deepcopy(module), batches, m, opt, precision, init_scale, device,
                      masks=masks())
    twin = eager_train(copy.deepcopy(module), reordered(batches, m), m, opt, precision,
                       init_scale, device, masks=masks(batches[0][0].shape[0] // m))
    flips = None
    if opt.kind == OptimizerKind.ADAMW:
        if precision != Precision.FP32 and wide is None:
            wide = eager_train(copy.deepcopy(module), batches, m, opt, device=device,
                               masks=masks())
        flips = adam_flips(ref.state, opt.lr, len(batches), opt.betas,
                           wide=wide.state if precision != Precision.FP32 and wide else None)
    verdict = judge(rank_losses, slices, ref, bounds or BOUNDS[precision], twin, flips,
                    eager_state(module), rank_grad_norms)
    if verdict["ok"]:
        return verdict, ref
    # the reference's own rounding error only widens the bounds: a run within
    # them is judged without it. fp32's: float64's training, and ReLUs flipped
    # where fp32 cannot tell; bf16's and fp16's: fp32's training
    flipped, exact = None, wide
    if precision == Precision.FP32:
        flipped = eager_train(copy.deepcopy(module), batches, m, opt, precision, init_scale,
                              device, masks=masks(), flip_kinks=True)
        exact = exact_train(module, batches, m, opt, device, masks())
    elif exact is None:
        exact = eager_train(copy.deepcopy(module), batches, m, opt, device=device,
                            masks=masks())
    return judge(rank_losses, slices, ref, bounds or BOUNDS[precision], twin, flips,
                 eager_state(module), rank_grad_norms, exact, flipped), ref


def exact_train(module, batches: list[tuple], m: int, opt: OptimizerConfig, device: str,
                masks) -> EagerRun | None:
    """The eager reference in float64: its distance from the fp32 one is
    fp32's own rounding error on this model (the judge's second noise); None
    for a model that will not run in float64 (a cast to float32 inside)."""
    wide = tuple(tuple(t.double() if t.is_floating_point() else t for t in b) for b in batches)
    try:
        return eager_train(copy.deepcopy(module).double(), wide, m, opt, Precision.FP32,
                           INIT_SCALE, device, masks=masks)
    except Exception:  # noqa: BLE001 - the user's model, run in a dtype it was not written for
        return None


def judge(rank_losses: dict[str, list[float]], slices: dict[int, dict], ref: EagerRun,
          bounds: Bounds, twin: EagerRun | None = None, flips: Flips | None = None,
          start: dict | None = None,
          rank_grad_norms: dict[str, list[float]] | None = None,
          exact: EagerRun | None = None, flipped: EagerRun | None = None) -> dict:
    """The verdict on a run, from its ranks' losses and final state slices:
    `ok`, `problems` (one line each), `max_abs_diff` (losses), and per tensor
    `params` (parameters and buffers) and `optimizer_state` (slots, the loss
    scale) with `max_abs`, `max_rel`, `ok`. `twin`, the reference trained
    on `reordered` batches, gives each tensor's reordering noise; `flips`,
    AdamW's rounding-decided elements (`compare.adam_flips`); `start`, the
    initial state, each tensor's update (`compare.update_rel`); `rank_grad_norms`,
    each rank's gradient norm per step, against `clip_grad_norm_`'s; `exact`,
    the reference in float64, each tensor's and the loss's fp32 rounding error
    (a second noise: a plan's rounding differs from eager's by as much);
    `flipped`, the reference with its ReLUs on the other side where fp32
    cannot tell (`kinks.py`), each element's distance from it a noise there
    (elementwise: a flip moves the rows it touches, and only those). For a
    bf16/fp16 reference `exact` is the fp32 training: its distance is
    autocast's own error, and so is eager's update's distance from fp32's
    for each tensor's update (a gradient mostly rounding, Qwen2's key bias:
    eager autocast's update 50-80% off fp32's; a MoE router's)."""
    loss_noise, noise = 0.0, {}
    if twin is not None:
        loss_noise = max(abs(a - b) for a, b in zip(ref.losses, twin.losses, strict=True))
        noise = {k: max_abs(t, twin.state[k]) for k, t in ref.state.items() if k in twin.state}
    loss_error = loss_noise
    for other in (r for r in (exact, flipped) if r is not None):
        loss_error = max(loss_error, *(abs(a - b) for a, b in zip(ref.losses, other.losses)))
    if exact is not None:
        noise = {k: max(noise.get(k, 0.0), max_abs(t, exact.state[k]))
                 if k in exact.state else noise.get(k, 0.0) for k, t in ref.state.items()}
    if flipped is not None:
        noise = {k: gap_of(t, flipped.state[k]).clamp_min(noise.get(k, 0.0))
                 if k in flipped.state and t.shape == flipped.state[k].shape
                 else noise.get(k, 0.0) for k, t in ref.state.items()}
    losses = compare_losses(rank_losses, ref.losses, bounds, loss_error)
    shapes = {k: tuple(t.shape) for k, t in ref.state.items()}
    own = {k: update_rel(ref.state[k], exact.state[k], start[k]) or 0.0
           for k in ref.state if k in start and k in exact.state
           and exact.state[k].shape == ref.state[k].shape} \
        if exact is not None and start is not None else {}
    state = compare_state(assemble(slices, shapes), ref.state, bounds, noise, flips, start, own)
    norms = compare_norms(rank_grad_norms or {}, ref.grad_norms, bounds)
    problems = losses["problems"] + norms["problems"] + [
        f"{name}: {'held by no rank' if d.get('missing') else _describe(d)}"
        for name, d in state.items() if not d["ok"]]
    exact = losses["max_abs_diff"] == 0 and norms["max_rel_diff"] == 0 and \
        all(d.get("max_abs", 0.0) == 0 for d in state.values())
    if not exact:  # a run equal to eager bit for bit is judged, however chaotic eager is
        problems = chaos(loss_noise, bounds) + problems
    return {"ok": not problems, "problems": problems, "bounds": asdict(bounds),
            "bit_identical": exact, "grad_norm_max_rel_diff": norms["max_rel_diff"],
            "max_abs_diff": losses["max_abs_diff"], "loss_noise": loss_noise,
            "loss_bound_used": losses["bound_used"],
            "params": {k: d for k, d in state.items() if not is_state(k)},
            "optimizer_state": {k: d for k, d in state.items() if is_state(k)}}


def _describe(d: dict) -> str:
    text = f"max_abs {d['max_abs']:.2e}, max_rel {d['max_rel']:.2e}"
    if "replica_spread" in d:
        text += f", replicas differ by {d['replica_spread']:.2e}"
    if "update_rel" in d:
        text += f", update {d['update_rel']:.0%} off eager's"
    return text


def whole_slices(state: dict) -> dict[int, dict]:
    """A one-process executor's state as rank 0's slices, each whole."""
    return {0: {f"{k}|{box_key(tuple((0, n) for n in t.shape))}": t.detach().cpu()
                for k, t in state.items() if t is not None}}


def reordered(batches: list[tuple], m: int) -> list[tuple]:
    """`batches` with each micro-batch's samples in reverse order: the same
    training mathematically (every loss is a mean, BatchNorm's statistics are
    sums), with other rounding in every sum over the batch."""
    out = []
    for batch in batches:
        n = batch[0].shape[0]
        size = n // m
        index = torch.cat([torch.arange(k * size + size - 1, k * size - 1, -1)
                           for k in range(m)])
        out.append(tuple(t.index_select(0, index) for t in batch))
    return out


def reset_peak(device: str) -> None:
    """Start a fresh allocator peak (cuda; nothing on cpu)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_of(device: str) -> int | None:
    """The allocator's peak since `reset_peak` (cuda), else None."""
    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def mean_rel_diff(a: list[float], b: list[float]) -> float:
    """Mean over steps of |a - b| / |b|."""
    return statistics.fmean(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _single(module, batches, opt, m: int, precision: Precision = Precision.FP32,
            init_scale: float = INIT_SCALE, device: str = "cpu", kernels: str = "eager") -> dict:
    """meshplan on this one process: capture, autodiff, the one-rank executor."""
    micro = [split_microbatches(b, m) for b in batches]
    t0 = time.perf_counter()
    forward = capture(module, micro[0][0], precision=precision)
    t1 = time.perf_counter()
    strategy = Strategy(global_batch_size=m, precision=precision, initial_loss_scale=init_scale)
    graph = PASSES.run(Compilation(forward, Mesh(1, 1), strategy, opt),
                       stop_after="autodiff").graph
    t2 = time.perf_counter()
    reset_peak(device)
    ex = Executor(graph, device, kernels)
    state = ex.init_state(module)
    losses, times, norms = [], [], []
    for k, mbs in enumerate(micro):
        ts = time.perf_counter()
        try:
            losses.append(ex.step(state, mbs))  # a float: the step's end on a GPU
        except NonFiniteNorm as e:
            raise halted(k, e, ex.rank.step_losses.values()) from None
        times.append(time.perf_counter() - ts)
        norm = ex.rank.grad_norm(state)
        if norm is not None:
            norms.append(norm)
    return {"mode": "single", "losses": losses, "rank_losses": {"0": losses},
            "rank_grad_norms": {"0": norms} if norms else {},
            "slices": whole_slices(state), "ops": len(graph.ops),
            "capture_s": t1 - t0, "autodiff_s": t2 - t1,
            "step_s": steady_step_s(times),
            "measured_peak_bytes": peak_of(device) or ex.mem.peak,
            "live_peak_bytes": ex.mem.peak,
            "planned_peak_bytes": ex.rank.plan.memory.peak_bytes(),
            "attention_fallbacks": dict(FALLBACKS), "attention_ran": dict(RAN),
            "attention_kernels": sorted({ex.rank.plan.kernel_of(t, ex.graph)
                                         for t in ex.rank.plan.tasks
                                         if "attention" in ex.rank.plan.kernel_of(t, ex.graph)})}
