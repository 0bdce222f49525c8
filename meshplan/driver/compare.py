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
- AdamW (`Flips`): Adam's step is about +-lr whatever the gradient's size,
  so where a gradient is within rounding of zero its direction is rounding's
  choice, in eager as in any parallel plan. Those elements may differ by up
  to 2 * lr * steps; the moments (`exp_avg`, `exp_avg_sq`), linear and
  quadratic in the gradients, are still held to the elementwise bound, so a
  doubled or dropped gradient is caught there even though Adam's step is
  blind to its scale.
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

from dataclasses import dataclass

import torch

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


NOISE_FACTOR = 4.0
BOUNDS = {
    "fp32": Bounds(loss_atol=1e-5, atol=1e-5, rtol=1e-5),
    "bf16": Bounds(loss_atol=5e-3, atol=3e-3, rtol=2e-2, chaos=5e-3),
    "fp16": Bounds(loss_atol=5e-3, atol=3e-3, rtol=2e-2, chaos=5e-3),
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
                gap = (region.double() - t.double()).abs()[mask]
                spread[name] = max(spread[name], float(gap.max()) if gap.numel() else 0.0)
            region.copy_(torch.where(mask, region, t))
            mask.fill_(True)
    uncovered = tuple(sorted(n for n in shapes if n not in seen or not bool(seen[n].all())))
    return Assembled(full, spread, uncovered)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest elementwise |a - b| (0 for empty tensors)."""
    gap = (a.double() - b.double()).abs()
    return float(gap.max()) if gap.numel() else 0.0


@dataclass(frozen=True, slots=True)
class Flips:
    """AdamW's updates whose direction rounding decides (see the module note).

    Adam moves an element by about lr * m / sqrt(v): by +-lr whatever the
    gradient's size, so an element whose gradient is within rounding of zero
    moves one way or the other on the toss of its rounding. Such an element
    may differ from eager by up to `size` (2 * lr * steps): every element
    whose eager gradient RMS (sqrt of `exp_avg_sq`) is below `quiet` times
    its tensor's (attention's key bias: zero in exact arithmetic), and at
    most `fraction` of the others (measured: <= 0.8% in correct bf16 tp
    runs, from a gradient that was near zero at one step)."""

    size: float
    quiet: dict[str, torch.Tensor]  # parameter name -> bool mask of quiet elements
    fraction: float = 0.01


def adam_flips(ref: dict[str, torch.Tensor], lr: float, steps: int,
               quiet: float = 1e-2) -> Flips:
    """The `Flips` of an AdamW reference state after `steps` steps."""
    masks = {}
    for name, v in ref.items():
        param = name.removesuffix("@exp_avg_sq")
        if param != name and param in ref:
            rms = v.double().sqrt()
            masks[param] = rms <= quiet * rms.pow(2).mean().sqrt()
    return Flips(2 * lr * steps, masks)


def tensor_diff(mine: torch.Tensor, ref: torch.Tensor, bounds: Bounds,
                noise: float = 0.0, quiet: torch.Tensor | None = None,
                flips: Flips | None = None) -> dict:
    """Max absolute and relative difference of one tensor, and whether it
    passes; with `flips` and this tensor's `quiet` mask, AdamW's rounding-
    decided elements are allowed (counted in `flips`)."""
    a, b = mine.double(), ref.double()
    if a.shape != b.shape:
        return {"max_abs": float("inf"), "max_rel": float("inf"), "bound_used": float("inf"),
                "ok": False}
    gap = (a - b).abs()
    worst = float(gap.max()) if gap.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    allowed = bounds.atol + bounds.rtol * b.abs() + NOISE_FACTOR * noise
    out = gap > allowed
    d = {"max_abs": worst, "max_rel": worst / scale if scale > 0 else worst}
    if flips is not None and quiet is not None:
        loud = out & ~quiet
        forgiven = out if int(loud.sum()) <= flips.fraction * gap.numel() else out & quiet
        allowed = torch.where(forgiven, torch.full_like(allowed, flips.size), allowed)
        d["flips"] = int(forgiven.sum())
    d["ok"] = bool((gap <= allowed).all())
    d["bound_used"] = float((gap / allowed.clamp_min(1e-30)).max()) if gap.numel() else 0.0
    return d


def compare_state(assembled: Assembled, ref: dict[str, torch.Tensor], bounds: Bounds,
                  noise: dict[str, float] | None = None, flips: Flips | None = None) -> dict:
    """Per reference tensor: `max_abs`, `max_rel`, `bound_used`, `ok` (and
    `replica_spread` where replicas differ, `missing` where the run lacks it,
    `noise` where the reference's reordering noise is not zero, `flips` in
    an AdamW run)."""
    out = {}
    noise = noise or {}
    for name in sorted(ref):
        if name not in assembled.tensors or name in assembled.uncovered:
            out[name] = {"max_abs": float("inf"), "max_rel": float("inf"),
                         "bound_used": float("inf"), "ok": False, "missing": True}
            continue
        quiet = flips.quiet.get(name) if flips is not None else None
        d = tensor_diff(assembled.tensors[name], ref[name], bounds, noise.get(name, 0.0),
                        quiet, flips)
        if noise.get(name):
            d["noise"] = noise[name]
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
    if noise > bounds.chaos:
        problems.append(f"eager training is chaotic here: reversing the samples in each "
                        f"micro-batch alone moves its loss by {noise:.2e} (> {bounds.chaos:g}), "
                        "so rounding cannot be told from a bug; use fewer steps or a lower "
                        "learning rate")
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


def worst(params: dict, n: int = 3) -> list[tuple[str, dict]]:
    """The `n` tensors furthest from the reference, failing ones first."""
    return sorted(params.items(), key=lambda kv: (kv[1]["ok"], -kv[1]["max_rel"]))[:n]
