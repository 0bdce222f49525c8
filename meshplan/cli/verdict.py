"""How `verify` and `demo` report a verdict: the tolerance flag, and the
lines under the loss table (what was compared, the worst tensors, why a run
failed)."""

from __future__ import annotations

import argparse

from meshplan.driver.compare import Bounds, worst


def add_tolerance_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tolerance", type=float, default=None,
                   help="one bound for losses and state, absolute and relative (default: "
                   "the precision's: fp32 1e-5; bf16/fp16 from measured autocast noise, "
                   "docs/concepts/verify.md); exit 1 above it")


def add_reference_rng_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reference-rng", choices=("same", "torch"), default="same",
                   help="the eager reference's random ops (dropout): 'same' draws meshplan's "
                   "numbers, judged exactly (default); 'torch' draws torch's own in "
                   "--ref-runs runs of other seeds, the losses judged against their spread "
                   "(docs/concepts/verify.md)")
    p.add_argument("--ref-runs", type=int, default=5, metavar="N",
                   help="eager runs for --reference-rng torch (3 to 10; default 5)")


def bounds_of(a: argparse.Namespace) -> Bounds | None:
    t = a.tolerance
    return None if t is None else Bounds(loss_atol=t, atol=t, rtol=t)


def verdict_lines(r: dict) -> str:
    """OK or MISMATCH, the losses' figures, one summary line per kind of state
    ("53 parameter tensors, worst max_rel 3e-07 (blocks.2.mlp.fc2.weight)"),
    and the problems of a failed run."""
    b = r["bounds"]
    lines = [f"{'OK' if r['ok'] else 'MISMATCH'}: losses of {len(r['rank_losses'])} "
             f"loss-holding rank(s), max |diff| {r['max_abs_diff']:.2e} (bound "
             f"{b['loss_atol']:g}); state bound {b['atol']:g} + {b['rtol']:g}*|eager|"]
    for what, part in (("parameter tensors", r["params"]),
                       ("optimizer slots", r["optimizer_state"])):
        if part:
            (name, d), = worst(part, 1)
            lines.append(f"  {len(part)} {what}, worst max_rel {d['max_rel']:.0e} ({name})")
    if r.get("ref_grad_norms"):
        lines.append(f"  gradient norm at {len(r['ref_grad_norms'])} steps (clip_grad_norm_'s), "
                     f"worst rel {r['grad_norm_max_rel_diff']:.0e} (bound {b['rtol']:g}); "
                     f"last {r['grad_norms'][-1] if r.get('grad_norms') else float('nan'):.6g}")
    if r.get("bit_identical") and r.get("loss_noise", 0.0) > b["chaos"]:
        lines.append("  bit for bit equal to eager, so judged though eager is chaotic here")
    if r.get("reference_rng") == "torch":
        lines.append(f"  against {r['ref_runs']} eager runs drawing torch's own random numbers: "
                     "each step's loss within their spread's 99.9% prediction interval; "
                     "parameters not compared")
    lines += [f"  {p}" for p in r["problems"][:8]]
    if len(r["problems"]) > 8:
        lines.append(f"  ... {len(r['problems']) - 8} more (see --json)")
    if "vs_fp32" in r:
        v = r["vs_fp32"]
        lines.append(f"{r['precision']}, for information: mean relative loss difference "
                     f"{v['mean_rel_diff']:.2e} to eager fp32 (eager autocast: "
                     f"{v['autocast_mean_rel_diff']:.2e})")
    return "\n".join(lines)
