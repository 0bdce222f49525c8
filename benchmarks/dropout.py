"""What layout-invariant dropout costs a step: meshplan's counter-based
masks against aten's `native_dropout` (torch's generator), on GPT small.

One process, one thread, AdamW, GPT small (8 layers, hidden 256, seq 128,
batch 8), interleaved step by step so that machine noise hits every variant
alike:
- `meshplan p=0`: no dropout (the baseline);
- `meshplan p=0.1`: every dropout (25: the embedding's, and per block the
  attention weights' and two residual ones) a `meshplan.dropout`, masks from the counter-based
  generator (`ops/counter_rng.py`); attention with dropout runs as aten ops
  (`ops/random_ops.attention_math`) instead of the fused kernel;
- `meshplan p=0.1 native`: the same plan, each dropout's kernel swapped for
  aten's `native_dropout` (torch's generator, not layout-invariant): the
  generator's own cost is the difference between these two;
- `eager p=0` / `eager p=0.1`: the module itself (torch's dropout and its
  fused attention with dropout).
Dropout's cost per step is each p=0.1 variant's median step less its p=0's.

Run: python benchmarks/dropout.py [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, median, torch_step, write  # noqa: E402
from meshplan.autodiff.optimizer import OptimizerConfig, torch_optimizer  # noqa: E402
from meshplan.capture import capture  # noqa: E402
from meshplan.driver.executor import Executor  # noqa: E402
from meshplan.ir.kinds import DROPOUT  # noqa: E402
from meshplan.ir.mesh import Mesh, Strategy  # noqa: E402
from meshplan.models import build_model, example_batch, model_config  # noqa: E402
from meshplan.passes.plan import PASSES, Compilation  # noqa: E402
from meshplan.runtime import bind  # noqa: E402

BATCH, WARMUP = 8, 3
OPT = OptimizerConfig.default("adamw")


def _native(x, p, key, *, draw):
    """aten's dropout in place of the counter-based one (not layout-invariant)."""
    return torch.ops.aten.native_dropout.default(x, p, True)


def _meshplan(p: float, native: bool = False):
    cfg = model_config("gpt", "small", dropout=p)
    torch.manual_seed(0)
    module = build_model(cfg)
    data = example_batch(cfg, BATCH)
    step = PASSES.run(Compilation(capture(module, data), Mesh(1, 1), Strategy(), OPT),
                      stop_after="autodiff").graph
    kernel = bind.RANDOM_KERNELS[DROPOUT]
    bind.RANDOM_KERNELS[DROPOUT] = _native if native else kernel
    try:
        ex = Executor(step)  # binds each dropout's kernel now
    finally:
        bind.RANDOM_KERNELS[DROPOUT] = kernel
    state = ex.init_state(module)
    drops = sum(op.kind == DROPOUT for op in step.ops)
    return (lambda: ex.step(state, [data])), drops


def _eager(p: float):
    cfg = model_config("gpt", "small", dropout=p)
    torch.manual_seed(0)
    module = copy.deepcopy(build_model(cfg))
    data = example_batch(cfg, BATCH)
    return torch_step(module, torch_optimizer(OPT, module), data), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    variants = {"meshplan p=0": _meshplan(0.0), "meshplan p=0.1": _meshplan(0.1),
                "meshplan p=0.1 native": _meshplan(0.1, native=True),
                "eager p=0": _eager(0.0), "eager p=0.1": _eager(0.1)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(WARMUP + a.steps):
        for name, (step, _) in variants.items():
            t0 = time.perf_counter()
            step()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    step_s = {k: median(v) for k, v in times.items()}
    cost = {"meshplan p=0.1": step_s["meshplan p=0.1"] - step_s["meshplan p=0"],
            "meshplan p=0.1 native": step_s["meshplan p=0.1 native"] - step_s["meshplan p=0"],
            "eager p=0.1": step_s["eager p=0.1"] - step_s["eager p=0"]}
    drops = variants["meshplan p=0.1"][1]
    result = {"benchmark": "dropout", "model": "gpt-small", "batch": BATCH, "steps": a.steps,
              "threads": 1, "dropouts": drops, "machine": machine(), "step_s": step_s,
              "dropout_cost_s": cost,
              "counter_over_native": cost["meshplan p=0.1"] / cost["meshplan p=0.1 native"]}
    lines = [f"Dropout's cost per step, GPT small, batch {BATCH}, AdamW, 1 thread, median of "
             f"{a.steps} interleaved steps; {drops} dropouts at p=0.1.", "",
             "| variant | step (ms) | dropout's cost (ms) |", "|---|---|---|"]
    for k, s in step_s.items():
        c = f"{cost[k] * 1e3:.1f}" if k in cost else "(baseline)"
        lines.append(f"| {k} | {s * 1e3:.1f} | {c} |")
    lines += ["", f"Counter-based masks cost {result['counter_over_native']:.2f}x aten's "
              "`native_dropout` in the same plan."]
    write("dropout", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
