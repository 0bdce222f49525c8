"""Part 5 of `fused.py`: the optimizer's update with `--kernels inductor`.

GPT small's AdamW update (its parameters, with equal gradients for all,
in the groups meshplan's step calls it on: consecutive parameters with equal
weight decay), alternating step by step: torch's per-tensor loop (what
eager kernels and `torch.optim` run on a CPU), torch's fused kernel
(`fused=True`, what `--kernels inductor` runs) and Inductor's code for the
same per-tensor loop (`torch.compile`, as the optimizer's run was built
before), with the seconds Inductor took to build it and each contender's
largest difference from the loop after the steps. Beside them, the fused
kernel in one call for every parameter (what grouping further would save;
it decays every parameter, so its difference is not rounding).
"""

from __future__ import annotations

import statistics
import time

import torch

from meshplan.ir.optimizer_config import OptimizerConfig
from meshplan.models import build_model, model_config
from meshplan.ops import kernels

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


def optimizer_part(steps: int = 20, warmup: int = 3) -> dict:
    torch.manual_seed(0)
    named = list(build_model(model_config("gpt", "small")).named_parameters())
    params = [p.detach().clone() for _, p in named]
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    cfg = OptimizerConfig.default("adamw")
    groups: list[tuple[float, list[int]]] = []  # (weight decay, parameters), as the step's calls
    for i, (name, p) in enumerate(named):
        wd = cfg.weight_decay if cfg.decays(name, tuple(p.shape)) else 0.0
        if groups and groups[-1][0] == wd:
            groups[-1][1].append(i)
        else:
            groups.append((wd, [i]))

    def state():
        return ([p.clone() for p in params], [torch.zeros_like(p) for p in params],
                [torch.zeros_like(p) for p in params], [torch.tensor(0.0) for _ in params])

    def update(fused):
        def run(*lists):
            for wd, ids in groups:
                kernels.adamw_multi(*([x[i] for i in ids] for x in (lists[0], grads, *lists[1:])),
                                    fused=fused, weight_decay=wd, **HP)
        return run

    def one_call(*lists):  # the bound of grouping further: every parameter in one call
        kernels.adamw_multi(lists[0], grads, *lists[1:], fused=True,
                            weight_decay=cfg.weight_decay, **HP)

    contenders = {"per-tensor loop": update(False), "torch fused kernel": update(True),
                  "torch fused kernel, one call (every parameter decayed)": one_call,
                  "inductor": torch.compile(update(False))}
    states = {k: state() for k in contenders}
    t0 = time.perf_counter()
    contenders["inductor"](*states["inductor"])
    build_s = time.perf_counter() - t0
    states["inductor"] = state()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for i in range(warmup + steps):
        for name, run in contenders.items():
            t0 = time.perf_counter()
            run(*states[name])
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    loop = states["per-tensor loop"][0]
    return {"model": "gpt-small", "parameters": len(params), "calls": len(groups),
            "numel": sum(p.numel() for p in params), "steps": steps,
            "step_s": {k: statistics.median(v) for k, v in times.items()},
            "inductor_build_s": build_s,
            "max_diff_vs_loop": {k: max((a - b).abs().max().item()
                                        for a, b in zip(loop, states[k][0]))
                                 for k in contenders}}


def optimizer_table(r: dict) -> list[str]:
    lines = [f"## 5. The optimizer's update: {r['model']}'s AdamW, {r['parameters']} "
             f"parameters ({r['numel'] / 1e6:.1f} M values) in {r['calls']} calls (groups of "
             f"equal weight decay), median of {r['steps']} alternating steps", "",
             "| update | step (ms) | build (s) | max diff vs the loop |", "|---|---|---|---|"]
    for k, t in r["step_s"].items():
        build = f"{r['inductor_build_s']:.1f}" if k == "inductor" else "0"
        lines.append(f"| {k} | {t * 1e3:.2f} | {build} | {r['max_diff_vs_loop'][k]:.1e} |")
    return lines + [""]
