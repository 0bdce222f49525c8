"""The parts of `benchmarks/gpu_check.py`, each run in its own process:
`python benchmarks/gpu_parts.py PART --device cuda --result FILE`.

Invariants:
- A part writes its result file after every step it finishes (atomically),
  so a part killed at its time limit still leaves what it measured.
- A part judges itself (`ok`) against a stated criterion (`judged`); the
  numbers it judged are in the file beside the verdict.
- `--dry` runs the same code on a small model (and on CPU when `--device
  cpu`), to shake out the script's own bugs on a machine without a GPU.
- Only APIs present in torch 2.11 are used (the GPU machines' torch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# bf16 dense tensor-core peak, FLOP/s, by a substring of the device name
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


class Result:
    """A part's result file, rewritten whole after every `set`."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.data: dict = {}

    def set(self, **kw) -> None:
        self.data.update(kw)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def say(msg: str) -> None:
    print(msg, flush=True)


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


# ------------------------------------------------------------------ checks
def part_pytest(res: Result, a) -> None:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfEs", "-p",
           "no:cacheprovider", "tests"]
    say("running: " + " ".join(cmd[1:]))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = (p.stdout + p.stderr).strip().splitlines()
    summary = next((x for x in reversed(lines) if " in " in x and ("passed" in x or "skipped"
                                                                   in x or "failed" in x)), "")
    for x in lines[-25:]:
        say(x)
    ran = "passed" in summary or "failed" in summary
    res.set(ok=p.returncode == 0 and (ran or a.dry), rc=p.returncode, summary=summary,
            judged="pytest -m cuda exits 0" + ("" if a.dry else " and runs tests"),
            tail=lines[-60:])


def _verify_result(res: Result, r: dict, judged: str) -> None:
    """Record verify's verdict (losses of every loss-holding rank and every
    parameter and optimizer slot against eager on the same device)."""
    keep = ("device", "losses", "ref_losses", "max_abs_diff", "loss_noise", "loss_bound_used",
            "vs_fp32", "step_s", "ref_step_s", "measured_peak_bytes", "planned_peak_bytes",
            "live_peak_bytes", "ref_measured_peak_bytes", "attention_kernels", "attention_ran",
            "mode")
    out = {k: r[k] for k in keep if k in r}
    if "ranks" in r:
        out["ranks"] = r["ranks"]
    state = r["params"] | r["optimizer_state"]
    name, d = max(state.items(), key=lambda kv: kv[1]["bound_used"])
    out |= {"tensors": len(state), "worst_tensor": name, "worst_bound_used": d["bound_used"],
            "worst_max_rel": d["max_rel"], "problems": r["problems"][:8]}
    say(f"{judged}: {'OK' if r['ok'] else 'MISMATCH'}; max |loss diff| "
        f"{r['max_abs_diff']:.2e}; {len(state)} tensors, worst {name} "
        f"(max_rel {d['max_rel']:.1e}, {d['bound_used']:.2f} of its bound)")
    for problem in r["problems"][:8]:
        say(f"  {problem}")
    res.set(ok=r["ok"], judged=judged, **out)


def _tiny_strategy(**fields):
    from meshplan.driver.plan import zoo_strategy
    from meshplan.models import model_config

    return zoo_strategy("gpt", model_config("gpt", "tiny"), **fields)


def part_verify_fp32(res: Result, a) -> None:
    from meshplan.driver.verify import verify

    r = verify("gpt", "tiny", steps=a.steps, optimizer="adamw", device=a.device)
    _verify_result(res, r, "GPT tiny fp32 AdamW, 1 device, vs eager on it: verify's verdict "
                   "(losses and every parameter and slot, fp32 bounds)")


def part_verify_bf16(res: Result, a) -> None:
    from meshplan.driver.verify import verify
    from meshplan.ir.mesh import Mesh

    s = _tiny_strategy(global_batch_size=8, micro_batch_size=8, precision="bf16")
    r = verify("gpt", "tiny", steps=a.steps, optimizer="adamw", mesh=Mesh(1, 1), strategy=s,
               device=a.device)
    _verify_result(res, r, "GPT tiny bf16 AdamW vs eager autocast on the device: verify's "
                   "verdict (bf16 bounds; vs fp32 for information)")


def _two_ranks(res: Result, a, judged: str, model: str = "gpt", over: dict | None = None,
               **fields) -> dict:
    """verify's verdict for `model` tiny (with config overrides `over`) on
    two ranks sharing the one device through host-staged gloo."""
    from meshplan.driver.plan import zoo_strategy
    from meshplan.driver.verify import verify
    from meshplan.ir.mesh import Mesh
    from meshplan.models import model_config

    over = over or {}
    strategy = zoo_strategy(model, model_config(model, "tiny", **over), **fields)
    r = verify(model, "tiny", steps=a.steps, optimizer="adamw", mesh=Mesh(1, 2),
               strategy=strategy, device=a.device,
               run_options={"backend": "gloo", "timeout_s": 120.0}, **over)
    _verify_result(res, r, judged)
    return r


def part_verify_pp2_vpp2(res: Result, a) -> None:
    _two_ranks(res, a, "GPT tiny pp=2 vpp=2 (interleaved, 4 micro-batches), 2 ranks on one "
               "device, host-staged gloo: verify's verdict", pp=2, vpp=2,
               schedule="interleaved", global_batch_size=8, micro_batch_size=2)


def part_verify_tp2(res: Result, a) -> None:
    _two_ranks(res, a, "GPT tiny tp=2, 2 ranks on one device, host-staged gloo: "
               "verify's verdict", tp=2, global_batch_size=8, micro_batch_size=8)


def part_verify_cp2(res: Result, a) -> None:
    """Context parallelism (issue 37): GPT tiny at seq 256 with its sequence
    split over cp=2 (causal, load-balanced zigzag chunks)."""
    _two_ranks(res, a, "GPT tiny seq 256 cp=2 (causal, zigzag), 2 ranks on one device, "
               "host-staged gloo: verify's verdict", over={"seq_len": 256}, cp=2,
               global_batch_size=4, micro_batch_size=4)


def part_verify_cp2_ring(res: Result, a) -> None:
    """Ring attention (issue 37, `--cp-attention ring`): the same GPT at cp=2,
    its keys and values passed around the ring inside the attention kernel
    (the device's own kernel per block; the shifts host-staged)."""
    _two_ranks(res, a, "GPT tiny seq 256 cp=2 ring attention (causal, zigzag), 2 ranks on one "
               "device, host-staged gloo: verify's verdict", over={"seq_len": 256}, cp=2,
               cp_attention="ring", global_batch_size=4, micro_batch_size=4)


def part_verify_moe_ep2(res: Result, a) -> None:
    """Expert parallelism (issue 38): the zoo MoE tiny, dropless, experts
    split over ep=2 (dp=2), tokens dispatched and combined by all-to-alls."""
    _two_ranks(res, a, "zoo MoE tiny dropless dp=2 ep=2, 2 ranks on one device, host-staged "
               "gloo: verify's verdict (router and experts included)", model="moe", dp=2,
               ep=2, global_batch_size=8, micro_batch_size=2)


def part_verify_hf_moe_ep2(res: Result, a) -> None:
    """transformers' Mixtral tiny at dp=2 ep=2: its expert blocks fused into
    routed ops, each rank's rows sent to their experts' rank by all-to-alls
    inside the kernel, the per-expert counts exchanged first (needs
    transformers)."""
    _two_ranks(res, a, "transformers' Mixtral tiny dp=2 ep=2 (routed experts), 2 ranks on "
               "one device, host-staged gloo: verify's verdict (router and experts included)",
               model="hf:mixtral", dp=2, ep=2, global_batch_size=8, micro_batch_size=2)


def part_dropout(res: Result, a) -> None:
    """Layout-invariant dropout on the device (issue 36): the counter-based
    generator's words on it equal the CPU's bit for bit, and GPT tiny with
    dropout 0.1 (attention's too, as aten ops) at tp=2 verifies equal to
    eager on the device drawing the same masks."""
    import torch

    from meshplan.ops import counter_rng as rng

    shape = (8, 8, 128, 128)
    stream = rng.Stream(rng.key_words(3, 5, 7), 11)
    box = ((0, 8), (2, 6), (0, 128), (0, 128))
    same = all(torch.equal(f(box, shape, stream, a.device).cpu(), f(box, shape, stream))
               for f in (rng.bits, lambda *x: rng.keep_mask(*x[:2], 0.1, *x[2:])))
    say(f"counter-based words on {a.device} equal the CPU's: {same}")
    r = _two_ranks(res, a, "GPT tiny dropout 0.1 tp=2, 2 ranks on one device: verify's "
                   "verdict against eager drawing the same masks", over={"dropout": 0.1}, tp=2,
                   global_batch_size=8, micro_batch_size=8)
    res.set(ok=r["ok"] and same, bits_equal_cpu=same)


# ------------------------------------------------------------------ speed
def speed_config(dry: bool):
    """(model config, batch, overrides): GPT ~1.3B at seq 2048, or a small one."""
    from meshplan.models import model_config

    over = (dict(layers=2, heads=4, hidden=128, seq_len=128, vocab=512) if dry else
            dict(layers=24, heads=16, hidden=2048, seq_len=2048, vocab=50304))
    return model_config("gpt", "small", **over), (4 if dry else 8), over


def model_flops(cfg, params: int, tokens: int) -> float:
    """6 * params * tokens, plus attention's score and value matmuls forward and
    backward, 12 * layers * hidden * seq * tokens (the full, uncausal square,
    as Megatron and PaLM count it)."""
    return 6 * params * tokens + 12 * cfg.layers * cfg.hidden * cfg.seq_len * tokens


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_steps(step, dev, warmup: int, iters: int, res: Result, prefix: str) -> list[float]:
    """Seconds of each timed step (CUDA events on a GPU); warm-up steps first."""
    for i in range(warmup):
        t0 = time.perf_counter()
        step()
        _sync(dev)
        say(f"{prefix}: warm-up step {i} took {time.perf_counter() - t0:.2f} s")
        res.set(**{f"{prefix}_warmup{i}_s": time.perf_counter() - t0})
    times = []
    for i in range(iters):
        if dev.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        say(f"{prefix}: step {i} {times[-1] * 1e3:.1f} ms")
    return times


def _speed_record(res: Result, a, cfg, params: int, batch: int, times: list[float],
                  dev, **extra) -> None:
    tokens = batch * cfg.seq_len
    step_s = statistics.median(times)
    flops = model_flops(cfg, params, tokens)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = a.peak_tflops * 1e12 if a.peak_tflops else peak_flops(name)
    out = {"step_s": step_s, "steps_s": times, "tokens": tokens, "params": params,
           "model_flops": flops, "tflops": flops / step_s / 1e12,
           "peak_tflops": peak / 1e12 if peak else None,
           "fraction_of_peak": flops / step_s / peak if peak else None,
           "measured_peak_bytes": (int(torch.cuda.max_memory_allocated(dev))
                                   if dev.type == "cuda" else None),
           "config": {"layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
                      "seq_len": cfg.seq_len, "vocab": cfg.vocab, "batch": batch}}
    out |= extra
    say(f"median step {step_s * 1e3:.1f} ms, {out['tflops']:.1f} TFLOP/s"
        + (f" ({out['fraction_of_peak']:.1%} of peak)" if peak else ""))
    res.set(ok=True, judged="ran and timed (targets are judged in the report)", **out)


def _meshplan_step(cfg, batch: int, over: dict, dev, res: Result, kernels: str = "eager"):
    """A ready meshplan step on `dev` (plan, lowering, state); its facts go to `res`."""
    from meshplan.driver.plan import plan_model, zoo_strategy
    from meshplan.ir.mesh import Mesh
    from meshplan.lowering.lower import lower
    from meshplan.models import build_model, example_batch, param_count
    from meshplan.runtime.data import split_microbatches
    from meshplan.runtime.rank_executor import RankExecutor

    t0 = time.perf_counter()
    strategy = zoo_strategy("gpt", cfg, global_batch_size=batch, micro_batch_size=batch,
                            precision="bf16")
    job = plan_model("gpt", "small", Mesh(1, 1), strategy, "adamw", None, **over).job
    t1 = time.perf_counter()
    plan = lower(job, 0, dev.type)
    attention = sorted({plan.kernel_of(t, job.graph) for t in plan.tasks
                        if "attention" in plan.kernel_of(t, job.graph)})
    say(f"planned in {t1 - t0:.1f} s ({len(job.graph.ops)} ops), lowered in "
        f"{time.perf_counter() - t1:.1f} s; attention kernels {attention}")
    res.set(plan_s=t1 - t0, ops=len(job.graph.ops), attention_kernels=attention,
            planned_peak_bytes=plan.memory.peak_bytes(), planned_peak=dict(plan.memory.peak))
    ex = RankExecutor(job, plan, None, device=dev, kernels=kernels)
    torch.manual_seed(0)
    module = build_model(cfg, device=dev)
    params = param_count(module)
    state = ex.init_state(module)
    del module
    _reset_peak(dev)
    mbs = split_microbatches(example_batch(cfg, batch, seed=0), 1)

    def step():
        return ex.step(state, mbs)

    return step, params, ex


def _reset_peak(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def part_speed_meshplan(res: Result, a, kernels: str = "eager") -> None:
    from meshplan.ops.device_kernels import FALLBACKS, RAN

    dev = torch.device(a.device)
    cfg, batch, over = speed_config(a.dry)
    step, params, ex = _meshplan_step(cfg, batch, over, dev, res, kernels)
    times = timed_steps(step, dev, a.warmup, a.iters, res, f"meshplan {kernels}")
    compile_s, notes = ex.kernel_compile()
    _speed_record(res, a, cfg, params, batch, times, dev, live_peak_bytes=ex.mem.peak,
                  planned_peak_bytes=ex.plan.memory.peak_bytes(),
                  attention_fallbacks=dict(FALLBACKS), attention_ran=dict(RAN),
                  kernels=kernels, kernel_compile_s=compile_s, kernel_notes=notes)


def part_speed_inductor(res: Result, a) -> None:
    """meshplan with `--kernels inductor` (issue 39): each run compiled."""
    part_speed_meshplan(res, a, "inductor")


def _eager_step(cfg, batch: int, dev, compiled: bool, backend: str):
    from meshplan.autodiff.optimizer import OptimizerConfig, torch_optimizer
    from meshplan.models import build_model, example_batch, param_count

    torch.manual_seed(0)
    model = build_model(cfg, device=dev)
    params = param_count(model)
    opt = torch_optimizer(OptimizerConfig.default("adamw", None), model)
    if compiled:  # regional compilation: every block shares one compiled graph, so the
        for block in model.blocks:  # compile takes one block's time, not 24 blocks'
            block.compile(backend=backend)
    data = tuple(t.to(dev) for t in example_batch(cfg, batch, seed=0))
    _reset_peak(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(*data)
        loss.backward()
        opt.step()
        return loss

    return step, params


def part_speed_eager(res: Result, a) -> None:
    dev = torch.device(a.device)
    cfg, batch, _ = speed_config(a.dry)
    step, params = _eager_step(cfg, batch, dev, False, "")
    times = timed_steps(step, dev, a.warmup, a.iters, res, "eager")
    _speed_record(res, a, cfg, params, batch, times, dev)


def part_speed_compile(res: Result, a) -> None:
    dev = torch.device(a.device)
    cfg, batch, _ = speed_config(a.dry)
    backend = a.compile_backend or ("inductor" if dev.type == "cuda" else "aot_eager")
    res.set(compile_backend=backend)
    step, params = _eager_step(cfg, batch, dev, True, backend)
    times = timed_steps(step, dev, a.warmup, a.iters, res, "compiled")
    _speed_record(res, a, cfg, params, batch, times, dev, compile_backend=backend)


# Device activities CUPTI records that are not kernels or copies: waiting for
# room in the launch queue spans the GPU's work and must not count as busy.
_NOT_WORK = ("Command Buffer Full", "Activity Buffer Request", "Lazy Function Loading")
_KINDS = (("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
          ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention")),
          ("copy and cast", ("copy", "memcpy", "memset", "cast")),
          ("optimizer", ("multi_tensor", "adam", "foreach")))


def _kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in _KINDS if any(x in low for x in keys)), "other")


def _top(prof, n: int = 15) -> dict:
    """Where one profiled step's device time goes: the kernels and copies that
    ran on the GPU (busy = the union of their intervals, so overlap counts
    once), the top kernels and kinds by device time, and the top host ops."""
    from torch.autograd import DeviceType

    work = [e for e in prof.events() if e.device_type == DeviceType.CUDA
            and not any(e.name.startswith(x) for x in _NOT_WORK)]
    spans = sorted((e.time_range.start, e.time_range.end) for e in work)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name: dict = {}
    by_kind: dict = {}
    for e in work:
        us = e.time_range.end - e.time_range.start
        calls, total = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (calls + 1, total + us)
        by_kind[_kind(e.name)] = by_kind.get(_kind(e.name), 0.0) + us
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:n]
    cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total),
                 key=lambda e: -e.self_cpu_time_total)[:n]
    return {
        "device_busy_ms": busy / 1e3,
        "kernels": len(work),
        "device_by_kind_ms": {k: v / 1e3 for k, v in
                              sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_device": [[k, c, us / 1e3] for k, (c, us) in top],
        "top_cpu": [[e.key, e.count, e.self_cpu_time_total / 1e3] for e in cpu],
    }


def part_speed_profile(res: Result, a, names=("meshplan", "eager")) -> None:
    """Where one step's time goes, meshplan and eager: device busy time vs the
    step's wall time (launch-bound when far apart), and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(a.device)
    cfg, batch, over = speed_config(a.dry)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    backend = a.compile_backend or ("inductor" if dev.type == "cuda" else "aot_eager")
    for name in names:
        if name.startswith("meshplan"):
            kernels = "inductor" if name.endswith("inductor") else "eager"
            step = _meshplan_step(cfg, batch, over, dev, _Scratch(), kernels)[0]
        else:
            step = _eager_step(cfg, batch, dev, name == "torch.compile", backend)[0]
        timed_steps(step, dev, 2, 0, _Scratch(), f"profile {name}")
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            step()
            _sync(dev)
            wall = time.perf_counter() - t0
        top = _top(prof)
        say(f"{name}: wall {wall * 1e3:.1f} ms, device busy {top['device_busy_ms']:.1f} ms "
            f"({top['kernels']} kernels and copies); by kind {top['device_by_kind_ms']}")
        res.set(**{name: {"wall_ms": wall * 1e3, **top}})
        del step
        _reset_peak(dev)
    res.set(ok=True, judged="profiled one step each")


def part_profile_inductor(res: Result, a) -> None:
    """Where the step's time goes with `--kernels inductor` and with
    torch.compile of each block (issue 39: a missed target is profiled)."""
    part_speed_profile(res, a, ("meshplan inductor", "torch.compile"))


class _Scratch(Result):
    """A Result that keeps nothing (warm-ups whose numbers nobody reads)."""

    def __init__(self):
        self.data = {}

    def set(self, **kw) -> None:
        pass


PARTS = {
    "pytest_cuda": part_pytest,
    "verify_fp32": part_verify_fp32,
    "verify_bf16": part_verify_bf16,
    "verify_pp2_vpp2": part_verify_pp2_vpp2,
    "verify_tp2": part_verify_tp2,
    "dropout": part_dropout,
    "verify_cp2": part_verify_cp2,
    "verify_cp2_ring": part_verify_cp2_ring,
    "verify_moe_ep2": part_verify_moe_ep2,
    "verify_hf_moe_ep2": part_verify_hf_moe_ep2,
    "speed_meshplan": part_speed_meshplan,
    "speed_eager": part_speed_eager,
    "speed_compile": part_speed_compile,
    "speed_inductor": part_speed_inductor,
    "speed_profile": part_speed_profile,
    "profile_inductor": part_profile_inductor,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--result", required=True)
    p.add_argument("--dry", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--compile-backend", default="")
    a = p.parse_args()
    torch.manual_seed(0)
    res = Result(a.result)
    res.set(ok=False, started=time.time())
    PARTS[a.part](res, a)
    return 0 if res.data.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
