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
- When reordering alone moves the reference's loss by more than `chaos`, the
  training is chaotic (rounding grows exponentially) and no bound can tell
  rounding from a bug: the verdict fails and says so, rather than widening.
- `max_rel` is the largest difference over the reference tensor's largest
  magnitude (a scale-free summary; near-zero elements do not blow it up).
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
    chaos: float = 1e-3  # reordering noise in the loss above which nothing can be judged


NOISE_FACTOR = 4.0
BOUNDS = {
    "fp32": Bounds(loss_atol=1e-5, atol=1e-5, rtol=1e-5),
    "bf16": Bounds(loss_atol=5e-3, atol=3e-3, rtol=2e-2),
    "fp16": Bounds(loss_atol=5e-3, atol=3e-3, rtol=2e-2),
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


def tensor_diff(mine: torch.Tensor, ref: torch.Tensor, bounds: Bounds,
                noise: float = 0.0) -> dict:
    """Max absolute and relative difference of one tensor, and whether it passes."""
    a, b = mine.double(), ref.double()
    if a.shape != b.shape:
        return {"max_abs": float("inf"), "max_rel": float("inf"), "ok": False}
    gap = (a - b).abs()
    worst = float(gap.max()) if gap.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    allowed = bounds.atol + bounds.rtol * b.abs() + NOISE_FACTOR * noise
    return {"max_abs": worst, "max_rel": worst / scale if scale > 0 else worst,
            "ok": bool((gap <= allowed).all())}


def compare_state(assembled: Assembled, ref: dict[str, torch.Tensor], bounds: Bounds,
                  noise: dict[str, float] | None = None) -> dict:
    """Per reference tensor: `max_abs`, `max_rel`, `ok` (and `replica_spread`
    where replicas differ, `missing` where the run lacks it, `noise` where
    the reference's reordering noise is not zero)."""
    out = {}
    noise = noise or {}
    for name in sorted(ref):
        if name not in assembled.tensors or name in assembled.uncovered:
            out[name] = {"max_abs": float("inf"), "max_rel": float("inf"), "ok": False,
                         "missing": True}
            continue
        d = tensor_diff(assembled.tensors[name], ref[name], bounds, noise.get(name, 0.0))
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
    return {"max_abs_diff": worst, "problems": problems}


def worst(params: dict, n: int = 3) -> list[tuple[str, dict]]:
    """The `n` tensors furthest from the reference, failing ones first."""
    return sorted(params.items(), key=lambda kv: (kv[1]["ok"], -kv[1]["max_rel"]))[:n]
