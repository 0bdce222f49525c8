"""The `run` verb: locally spawned ranks, or this process as a torchrun rank."""

from __future__ import annotations

import argparse
import json

from meshplan.cli.auto_cmd import strategy_of
from meshplan.cli.flags import mesh_of, optimizer_config, overrides
from meshplan.driver.run import run, run_torchrun, under_torchrun
from meshplan.models import model_config
from meshplan.passes.expert_parallel import LOAD


def cmd_run(a: argparse.Namespace) -> int:
    cfg = model_config(a.model, a.size, **overrides(a))
    strategy = strategy_of(a, cfg)
    common = dict(steps=a.steps, optimizer=optimizer_config(a), seed=a.seed, threads=a.threads,
                  timeout_s=a.timeout, lr=a.lr, trace=a.trace, device=a.device,
                  backend=a.backend, kernels=a.kernels, **overrides(a))
    if under_torchrun():
        r = run_torchrun(a.model, a.size, mesh_of(a), strategy, save_dir=a.save_dir, **common)
        if r is None:  # not rank 0: rank 0 reports for everyone
            return 0
    else:
        with a.progress.task("training steps", a.steps) as update:
            r = run(a.model, a.size, mesh_of(a), strategy, plan_dir=a.plan_dir,
                    save_dir=a.save_dir, resume=a.resume, on_step=update, **common)
    if a.json:
        print(json.dumps({"losses": r.losses, "grad_norms": r.grad_norms, "step_s": r.step_s,
                          "skipped_steps": r.skipped_steps, "ranks": r.ranks,
                          "trace": r.trace, **({"reports": r.reports} if r.reports else {})}))
        return 0
    norms = r.grad_norms or [None] * len(r.losses)
    print(f"{'step':>4}  {'loss':>10}  {'step (ms)':>9}" + ("  grad norm" if r.grad_norms else ""))
    for i, (loss, t, n) in enumerate(zip(r.losses, r.step_s, norms)):
        print(f"{i:>4}  {loss:>10.6f}  {t * 1e3:>9.1f}" + (f"  {n:>9.4g}" if n is not None else ""))
    if r.skipped_steps:
        print(f"skipped {len(r.skipped_steps)} step(s) whose gradient norm was not finite "
              f"(--on-nonfinite skip): {', '.join(map(str, r.skipped_steps))}")
    peaks = [(v["planned_peak_bytes"], v["measured_peak_bytes"]) for v in r.ranks.values()]
    print(f"{len(peaks)} ranks; peak memory per rank planned "
          f"{max(p for p, _ in peaks) / 2**20:.2f} MiB, measured "
          f"{max(m for _, m in peaks) / 2**20:.2f} MiB")
    if a.kernels == "inductor":
        secs = [v.get("kernel_compile_s", 0.0) for v in r.ranks.values()]
        notes = [n for v in r.ranks.values() for n in v.get("kernel_notes", [])]
        print(f"Inductor: each rank's runs compiled (or loaded from the cache) in at most "
              f"{max(secs):.1f} s, at its first step" + "".join(f"\n  {n}" for n in notes[:5]))
    for line in load_lines(r.reports):
        print(line)
    if r.trace:
        print(trace_line(r.trace))
    return 0


def load_lines(reports: dict) -> list[str]:
    """A mixture of experts' load: each block's tokens per expert in the
    last step, and its busiest expert against the mean."""
    out = []
    for name, steps in reports.items():
        if name.startswith(LOAD) and steps:
            counts = [int(x) for x in steps[-1]]
            mean = sum(counts) / len(counts)
            out.append(f"tokens per expert, last step, {name.removeprefix(LOAD)}: "
                       f"{' '.join(map(str, counts))} (max/mean {max(counts) / mean:.2f})")
    return out


def trace_line(t: dict) -> str:
    """The sentence that reports a measured trace."""
    return (f"wrote {t['path']}: the last step measured on every rank, "
            f"{t['step_s'] * 1e3:.1f} ms, bubble ratio {t['bubble_ratio']:.3f} "
            "(open it in Perfetto or chrome://tracing)")


def loss_table(reference: list[float], mine: list[float]) -> str:
    """Eager's and meshplan's loss per step, side by side."""
    lines = [f"{'step':>4}  {'eager loss':>12}  {'meshplan loss':>13}  {'|diff|':>9}"]
    for i, (x, y) in enumerate(zip(reference, mine)):
        lines.append(f"{i:>4}  {x:>12.6f}  {y:>13.6f}  {abs(x - y):>9.2e}")
    return "\n".join(lines)
