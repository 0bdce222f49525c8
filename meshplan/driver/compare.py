"""The judge's arithmetic: assemble a run's final state from every rank's
slices, and compare losses and state with the eager reference.

Invariants:
- `assemble` places each slice at its box (`<name>|<box>`, the checkpoint's
  keys); where boxes overlap (replicas: dp, Broadcast tp, a parameter held on
  two stages) the slices must agree, and their largest difference is
  reported as the tensor's `replica_spread`. An element no rank holds is
  reported, never filled.
- A state tensor passes when every element is within
  `atol + rtol * |reference| + NOISE_FACTOR * noise` (the `torch.allclose`
  rule, widened by the tensor's measured reordering noise) and its replicas
  agree to `atol`; a loss curve passes when every step of every
  loss-holding rank is within `loss_atol + NOISE_FACTOR * loss noise` and
  no rank's curve is shorter.
- `noise` is how far a second eager run moves when only the order of its
  sums changes (each micro-batch's samples reversed: the same mathematics,
  other rounding, as a parallel plan's reductions). It is ~1e-8 for SGD;
  AdamW divides by sqrt(v) + eps and so turns the rounding of a gradient
  that is zero in exact arithmetic (attention's key bias) into updates of
  up to ~lr/10, the same in both runs' kind but not in value.
  A run the twin's noise does not cover (fp32 only) is judged again with a
  second noise, fp32's own rounding error: how far the reference trained in
  float64 is from the fp32 one (`verify.exact_train`). A plan's other
  reductions (tp's split sums) round by as much, and the twin, whose sums
  differ only in sample order, can see 100x less (CPM-Ant, Gemma 4 at
  tp2·pp2: the twin 1e-6, fp32 itself 1e-4, the run 3e-5). So is the
  distance, per element, from the reference with its ReLUs on the other side
  where fp32 cannot tell (`kinks.py`). They only widen the bounds, so a run
  within them is never run again.
- AdamW (`Flips`): Adam's step is about +-lr whatever the gradient's size,
  so where a gradient is within rounding of zero its direction is rounding's
  choice, in eager as in any parallel plan. Those elements may differ by up
  to 2 * lr * steps; the moments (`exp_avg`, `exp_avg_sq`), linear and
  quadratic in the gradients, are still held to the elementwise bound, so a
  doubled or dropped gradient is caught there even though Adam's step is
  blind to its scale.
- Each parameter's and buffer's update (final - initial) must also be
  within `update_rtol` of eager's in norm: an elementwise bound wide enough
  for bf16's rounding can be wider than what a slow tensor moves in a few
  steps (BERT tiny's fc1 weight, frozen for 5 SGD steps, used 0.34 of it);
  its update misses by 100%, rounding by well under 10%.
- When reordering alone moves the reference's loss by more than `chaos`, the
  training is chaotic (rounding grows exponentially) and no bound can tell
  rounding from a bug: the verdict fails and says so, rather than widening.
- `max_rel` is the largest difference over the reference tensor's largest
  magnitude (a scale-free summary; near-zero elements do not blow it up);
  `bound_used` is the largest elementwise difference over its allowance
  (above 1 fails).
- The bounds (`BOUNDS`) are per precision and measured (docs/concepts/verify.md):
  fp32 is rounding only; bf16/fp16 are set above eager autocast's own
  reordering noise and below a run that trains nothing or freezes a tensor.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from meshplan.ir.choices import Precision
from meshplan.runtime.checkpoint import parse_box
from meshplan.runtime.state import cut


@dataclass(frozen=True, slots=True)
class Bounds:
    """How close a run must be to its reference, per loss and per state element."""

    loss_atol: float
    atol: float
    rtol: float
    # reordering noise in the loss above which nothing can be judged: fp32 100x
    # its loss bound; bf16/fp16 the bound itself (eager autocast's own noise
    # is already 1.3e-3 for BERT tiny in 5 steps: CPU autocast runs LayerNorm in bf16)
    chaos: float = 1e-3
    # a parameter's or buffer's update (final - initial) may be this far from
    # eager's, in norm, outside AdamW's quiet elements: measured <= 0.004 for
    # SGD and <= 0.09 for AdamW in correct bf16 runs, 1.0 for a frozen tensor
    # (fp32: not needed, the elementwise bound is 1e-5)
    update_rtol: float = float("inf")


NOISE_FACTOR = 4.0
BOUNDS = {
    Precision.FP32: Bounds(loss_atol=1e-5, atol=1e-5, rtol=1e-5),
    Precision.BF16: Bounds(loss_atol=5e-3, atol=3e-3, rtol=2e-2, chaos=5e-3, update_rtol=0.25),
    Precision.FP16: Bounds(loss_atol=5e-3, atol=3e-3, rtol=2e-2, chaos=5e-3, update_rtol=0.25),
}


@dataclass(frozen=True, slots=True)
class Assembled:
    """A run's logical state, put together from the ranks' slices."""

    tensors: dict[str, torch.Tensor]
    replica_spread: dict[str, float]
    uncovered: tuple[str, ...]  # names with an element no rank holds


def assemble(slices: dict[int, dict[str, torch.Tensor]],
             shapes: dict[str, tuple[int, ...]]) -> Assembled:
    """The full tensors of `shapes` from `slices` (rank -> `<name>|<box>` -> tensor)."""
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    spread: dict[str, float] = {}
    for rank in sorted(slices):
        for key, t in slices[rank].items():
            name, _, box = key.partition("|")
            if name not in shapes:
                continue
            if name not in full:
                full[name] = torch.zeros(shapes[name], dtype=t.dtype)
                seen[name] = torch.zeros(shapes[name], dtype=torch.bool)
                spread[name] = 0.0
            region, mask = (cut(full[name], parse_box(box)), cut(seen[name], parse_box(box)))
            if mask.any():
                gap = gap_of(region, t)[mask]
                spread[name] = max(spread[name], float(gap.max()) if gap.numel() else 0.0)
            region.copy_(torch.where(mask, region, t))
            mask.fill_(True)
    uncovered = tuple(sorted(n for n in shapes if n not in seen or not bool(seen[n].all())))
    return Assembled(full, spread, uncovered)


def gap_of(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise |a - b| in double (of complex values: the distance in the
    plane); equal infinities and two NaNs agree (0), a NaN against a number
    is infinitely far."""
    a, b = wide(a), wide(b)
    same = (a == b) | (a.isnan() & b.isnan())
    return torch.where(same, 0.0, (a - b).abs().nan_to_num(float("inf")))


def wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in double precision, complex kept complex (a cast to double
    would drop the imaginary part)."""
    return t.to(torch.complex128) if t.is_complex() else t.double()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest elementwise |a - b| (0 for empty tensors)."""
    gap = gap_of(a, b)
    return float(gap.max()) if gap.numel() else 0.0


@dataclass(frozen=True, slots=True)
class Flips:
    """AdamW's updates whose direction rounding decides (see the module note).

    Adam moves an element by about lr * m / sqrt(v): by +-lr whatever the
    gradient's size, so an element whose gradient is within rounding of zero
    moves one way or the other on the toss of its rounding. Such an element
    may differ from eager by up to `size` (2 * lr * steps): every element
    whose eager gradient RMS (sqrt of `exp_avg_sq`) is below `quiet` times
    its tensor's (attention's key bias: zero in exact arithmetic), or, in a
    bf16/fp16 run, below fp32's own for it by as much, and at
    most `fraction` of the others, or `few` (measured: <= 0.8% in correct
    bf16 tp runs, from a gradient that was near zero at one step; 2-3 of a
    BERT LayerNorm bias's 64)."""

    size: float
    quiet: dict[str, torch.Tensor]  # parameter name -> bool mask of quiet elements
    fraction: float = 0.01
    few: int = 4  # a small tensor (a LayerNorm bias of 64) may still have this many


def adam_flips(ref: dict[str, torch.Tensor], lr: float, steps: int,
               betas: tuple[float, float] = (0.9, 0.999), quiet: float = 1e-2,
               wide: dict[str, torch.Tensor] | None = None) -> Flips:
    """The `Flips` of an AdamW reference state after `steps` steps: two runs
    part by at most twice Adam's largest step, lr * max(1, (1 - beta1) /
    sqrt(1 - beta2)) (Kingma & Ba, 2015, section 2.1), per step. `wide`, the
    same training in fp32 for a bf16/fp16 reference: an element whose
    gradient RMS there is below `quiet` of the reference's is quiet too, its
    gradient mostly rounding (a separate `k_proj.bias`, zero in exact
    arithmetic, is all such: quiet against its own tensor, none of it is)."""
    masks = {}
    for name, v in ref.items():
        param = name.removesuffix("@exp_avg_sq")
        if param != name and param in ref:
            rms = v.double().sqrt()
            masks[param] = rms <= quiet * rms.pow(2).mean().sqrt()
            if wide is not None and name in wide and wide[name].shape == v.shape:
                masks[param] |= wide[name].double().sqrt() <= quiet * rms
    largest = lr * max(1.0, (1 - betas[0]) / (1 - betas[1]) ** 0.5)
    return Flips(2 * largest * steps, masks)


def update_rel(mine: torch.Tensor, ref: torch.Tensor, start: torch.Tensor,
               quiet: torch.Tensor | None = None) -> float | None:
    """|mine - ref| / |ref - start| in norm (outside `quiet` elements): how far
    a tensor's update is from eager's; None where eager moved no element by
    1e-4 (an update of rounding's size has no direction to miss)."""
    gap, moved = wide(mine) - wide(ref), wide(ref) - wide(start)
    if quiet is not None:
        gap, moved = gap[~quiet], moved[~quiet]
    if not moved.numel() or float(moved.abs().max()) < 1e-4:
        return None
    return float(gap.norm()) / float(moved.norm())


def tensor_diff(mine: torch.Tensor, ref: torch.Tensor, bounds: Bounds,
                noise: float | torch.Tensor = 0.0, quiet: torch.Tensor | None = None,
                flips: Flips | None = None) -> dict:
    """Max absolute and relative difference of one tensor, and whether it
    passes (`noise`: the tensor's, or each element's); with `flips` and this
    tensor's `quiet` mask, AdamW's rounding-decided elements are allowed
    (counted in `flips`)."""
    a, b = wide(mine), wide(ref)
    if a.shape != b.shape:
        return {"max_abs": float("inf"), "max_rel": float("inf"), "bound_used": float("inf"),
                "ok": False}
    gap = gap_of(a, b)
    worst = float(gap.max()) if gap.numel() else 0.0
    mag = b.abs().nan_to_num(0.0, 0.0, 0.0)  # a diverged reference element allows no more
    scale = float(mag.max()) if b.numel() else 0.0
    allowed = bounds.atol + bounds.rtol * mag + NOISE_FACTOR * noise
    out = gap > allowed
    d = {"max_abs": worst, "max_rel": worst / scale if scale > 0 else worst}
    if flips is not None and quiet is not None:
        loud = out & ~quiet
        few = max(flips.few, flips.fraction * gap.numel())
        forgiven = out if int(loud.sum()) <= few else out & quiet
        allowed = torch.where(forgiven, torch.full_like(allowed, flips.size), allowed)
        d["flips"] = int(forgiven.sum())
    d["ok"] = bool((gap <= allowed).all())
    d["bound_used"] = float((gap / allowed.clamp_min(1e-30)).max()) if gap.numel() else 0.0
    return d


def compare_state(assembled: Assembled, ref: dict[str, torch.Tensor], bounds: Bounds,
                  noise: dict[str, float | torch.Tensor] | None = None,
                  flips: Flips | None = None,
                  start: dict[str, torch.Tensor] | None = None,
                  own_update: dict[str, float] | None = None) -> dict:
    """Per reference tensor: `max_abs`, `max_rel`, `bound_used`, `ok` (and
    `replica_spread` where replicas differ, `missing` where the run lacks it,
    `unused` where it lacks it and eager left it at its `start` value,
    `noise` where the reference's reordering noise is not zero, `flips` in
    an AdamW run, `update_rel` for a tensor in `start`, the initial state,
    within `update_rtol` or `NOISE_FACTOR` times the reference's own
    (`own_update`: its update's distance from a wider training's))."""
    out = {}
    noise = noise or {}
    for name in sorted(ref):
        if name not in assembled.tensors and start is not None and name in start \
                and torch.equal(ref[name], start[name]):
            # no rank holds it because no op of the step reads it; eager left it as
            # it started too (no gradient: torch.optim skips it), and so did the run
            out[name] = {"max_abs": 0.0, "max_rel": 0.0, "bound_used": 0.0, "ok": True,
                         "unused": True}
            continue
        if name not in assembled.tensors or name in assembled.uncovered:
            out[name] = {"max_abs": float("inf"), "max_rel": float("inf"),
                         "bound_used": float("inf"), "ok": False, "missing": True}
            continue
        quiet = flips.quiet.get(name) if flips is not None else None
        d = tensor_diff(assembled.tensors[name], ref[name], bounds, noise.get(name, 0.0),
                        quiet, flips)
        most = torch.as_tensor(noise.get(name, 0.0))  # the tensor's, or its elements'
        if most.numel() and float(most.max()):
            d["noise"] = float(most.max())
        if start is not None and name in start:
            rel = update_rel(assembled.tensors[name], ref[name], start[name], quiet)
            if rel is not None:
                allowed = max(bounds.update_rtol, NOISE_FACTOR * (own_update or {}).get(name, 0.0))
                d |= {"update_rel": rel, "ok": d["ok"] and rel <= allowed}
        spread = assembled.replica_spread.get(name, 0.0)
        if spread > 0:
            d |= {"replica_spread": spread, "ok": d["ok"] and spread <= bounds.atol}
        out[name] = d
    return out


def compare_losses(rank_losses: dict[str, list[float]], ref: list[float],
                   bounds: Bounds, noise: float = 0.0) -> dict:
    """Every loss-holding rank's curve against the reference, step by step."""
    worst, problems = 0.0, []
    allowed = bounds.loss_atol + NOISE_FACTOR * noise
    if not rank_losses:
        problems.append("no rank reported a loss")
    for rank, losses in sorted(rank_losses.items(), key=lambda kv: int(kv[0])):
        if len(losses) != len(ref):
            problems.append(f"rank {rank} reported {len(losses)} losses for {len(ref)} steps")
            continue
        for step, (a, b) in enumerate(zip(losses, ref)):
            gap = abs(a - b)
            worst = max(worst, gap) if gap == gap else float("inf")
            if not gap <= allowed:
                problems.append(f"rank {rank} step {step}: loss {a:.6g} vs eager {b:.6g}")
    return {"max_abs_diff": worst, "bound_used": worst / allowed if allowed > 0 else worst,
            "problems": problems}


def chaos(noise: float, bounds: Bounds) -> list[str]:
    """The refusal to judge a run that differs from eager where eager's own
    reordering noise is above `bounds.chaos`."""
    if noise <= bounds.chaos:
        return []
    return [f"eager training is chaotic here: reversing the samples in each micro-batch "
            f"alone moves its loss by {noise:.2e} (> {bounds.chaos:g}), and the run is not "
            "equal to eager bit for bit, so rounding cannot be told from a bug; use fewer "
            "steps or a lower learning rate"]


def compare_norms(rank_norms: dict[str, list[float]], ref: list[float],
                  bounds: Bounds) -> dict:
    """Every rank's gradient norm per step against `clip_grad_norm_`'s: the
    same on every rank (one factor for all), within `bounds.rtol` of eager's
    (non-finite where eager's is)."""
    problems: list[str] = []
    worst = 0.0
    if ref and not rank_norms:
        problems.append("clipping is on but no rank reported a gradient norm")
    for rank, norms in sorted(rank_norms.items(), key=lambda kv: int(kv[0])):
        if len(norms) != len(ref):
            problems.append(f"rank {rank} reported {len(norms)} gradient norms for "
                            f"{len(ref)} steps")
            continue
        for step, (a, b) in enumerate(zip(norms, ref)):
            if not (math.isfinite(a) and math.isfinite(b)):
                if math.isfinite(a) != math.isfinite(b):
                    problems.append(f"rank {rank} step {step}: gradient norm {a:.6g} vs "
                                    f"eager {b:.6g}")
                continue
            rel = abs(a - b) / max(abs(b), 1e-30)
            worst = max(worst, rel)
            if rel > bounds.rtol:
                problems.append(f"rank {rank} step {step}: gradient norm {a:.6g} vs eager "
                                f"{b:.6g} (rel {rel:.1e} > {bounds.rtol:g})")
    curves = {tuple(v) for v in rank_norms.values()}
    if len(curves) > 1:
        problems.append(f"the ranks' gradient norms differ ({len(curves)} distinct curves): "
                        "their clipping factors would differ")
    return {"max_rel_diff": worst, "problems": problems}


def worst(params: dict, n: int = 3) -> list[tuple[str, dict]]:
    """The `n` tensors furthest from the reference, failing ones first."""
    return sorted(params.items(), key=lambda kv: (kv[1]["ok"], -kv[1]["max_rel"]))[:n]


# Student's t at 99.9% two-sided, by degrees of freedom (the runs less one)
_T999 = {2: 31.60, 3: 12.92, 4: 8.610, 5: 6.869, 6: 5.959, 7: 5.408, 8: 5.041, 9: 4.781}


def spread_verdict(rank_losses: dict[str, list[float]], runs: list[list[float]]) -> dict:
    """A run against eager runs whose random ops drew other numbers (torch's
    own generator, one seed each): a statistical judgement, losses only.
    At each step the run's loss must lie in the 99.9% prediction interval
    of one more such run, from the runs' mean m and sample deviation s:
    |loss - m| <= t * s * sqrt(1 + 1/n) (t Student's at n - 1 degrees of
    freedom; docs/concepts/verify.md). Parameters are not compared: other
    masks make other weights."""
    n = len(runs)
    assert n - 1 in _T999, f"{n} eager runs; the spread needs 3 to 10"
    steps = len(runs[0])
    mean = [statistics.fmean(r[k] for r in runs) for k in range(steps)]
    sd = [statistics.stdev([r[k] for r in runs]) for k in range(steps)]
    bound = [_T999[n - 1] * s * math.sqrt(1 + 1 / n) for s in sd]
    problems, worst = [], 0.0
    for rank, losses in sorted(rank_losses.items(), key=lambda kv: int(kv[0])):
        for k, (a, m, b) in enumerate(zip(losses, mean, bound, strict=True)):
            worst = max(worst, abs(a - m))
            if abs(a - m) > b:
                problems.append(f"rank {rank} step {k}: loss {a:.6f} is {abs(a - m):.2e} from "
                                f"the {n} eager runs' mean {m:.6f}, beyond their spread's "
                                f"99.9% bound {b:.2e}")
    return {"ok": not problems, "problems": problems, "max_abs_diff": worst,
            "params": {}, "optimizer_state": {}, "ref_runs": n, "ref_mean": mean,
            "ref_sd": sd, "spread_bound": bound,
            "bounds": {"loss_atol": max(bound), "atol": 0.0, "rtol": 0.0, "chaos": 0.0}}
