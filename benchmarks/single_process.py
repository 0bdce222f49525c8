"""Single-process step time: meshplan's executor vs eager PyTorch.

Both train the same GPT (tiny and small) with the same optimizer on the same
batches, in one process, interleaved step by step so that machine noise hits
both alike. The ratio is meshplan / eager (target <= 1.05).

Run: python benchmarks/single_process.py [--threads N] [--steps K]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from common import machine, median, torch_step, write  # noqa: E402

from meshplan.autodiff.optimizer import OptimizerConfig, torch_optimizer  # noqa: E402
from meshplan.capture import capture  # noqa: E402
from meshplan.driver.executor import Executor  # noqa: E402
from meshplan.ir.mesh import Mesh, Strategy  # noqa: E402
from meshplan.models import build_model, example_batch, model_config  # noqa: E402
from meshplan.passes.plan import PASSES, Compilation  # noqa: E402


def bench(size: str, batch: int, steps: int, warmup: int) -> dict:
    cfg = model_config("gpt", size)
    torch.manual_seed(0)
    module = build_model(cfg)
    ref = copy.deepcopy(module)
    opt_cfg = OptimizerConfig.default("adamw")
    data = example_batch(cfg, batch)
    step = PASSES.run(Compilation(capture(module, data), Mesh(1, 1), Strategy(), opt_cfg),
                      stop_after="autodiff").graph
    ex = Executor(step)
    state = ex.init_state(module)
    eager_step = torch_step(ref, torch_optimizer(opt_cfg, ref), data)

    mesh, eager = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        ex.step(state, [data])
        t1 = time.perf_counter()
        eager_step()
        t2 = time.perf_counter()
        if i >= warmup:
            mesh.append(t1 - t0)
            eager.append(t2 - t1)
    return {
        "model": f"gpt-{size}", "batch": batch, "steps": steps,
        "meshplan_step_s": median(mesh), "eager_step_s": median(eager),
        "ratio": median(mesh) / median(eager), "ops": len(ex.graph.ops),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [bench("tiny", 8, a.steps * 4, 10), bench("small", 8, a.steps, 3)]
    result = {"benchmark": "single_process", "target_ratio": 1.05, "machine": machine(),
              "rows": rows}
    lines = ["| model | batch | ops | meshplan step (ms) | eager step (ms) | ratio |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['ops']} | "
                     f"{r['meshplan_step_s'] * 1e3:.2f} | {r['eager_step_s'] * 1e3:.2f} | "
                     f"{r['ratio']:.3f} |")
    table = (f"Single-process step time, AdamW, {a.threads} thread(s), median of interleaved "
             f"steps; target ratio <= 1.05.\n\n" + "\n".join(lines) + "\n")
    write("single_process", result, table)


if __name__ == "__main__":
    main()
