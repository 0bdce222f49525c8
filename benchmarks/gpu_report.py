"""gpu.json and gpu.md from the parts of `benchmarks/gpu_check.py`.

Invariant: the report is rewritten whole after every part, from the parts
done so far, so it is always a complete account of what ran.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Targets of issue #14 (benchmarks, not tests).
MAX_RATIO_TO_EAGER = 1.05
MIN_FRACTION_OF_PEAK = 0.45


def _gib(x) -> str:
    return f"{x / 2**30:.2f}" if isinstance(x, (int, float)) and x else "-"


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _summary(part: dict) -> str:
    r = part.get("result", {})
    if part["status"] == "skipped":
        return part.get("why", "")
    bits = []
    if "max_abs_diff" in r:
        bits.append(f"max abs diff {r['max_abs_diff']:.2e}")
    if "worst_tensor" in r:
        bits.append(f"{r['tensors']} tensors, worst {r['worst_tensor']} "
                    f"({r['worst_bound_used']:.2f} of its bound)")
    if "vs_fp32" in r:
        bits.append(f"vs fp32 mean rel {r['vs_fp32']['mean_rel_diff']:.2e}")
    if "step_s" in r:
        bits.append(f"step {r['step_s'] * 1e3:.1f} ms")
    if "summary" in r:
        bits.append(r["summary"])
    if r.get("attention_kernels"):
        bits.append("attention: " + ", ".join(k.split(".")[1] for k in
                                              r["attention_kernels"]))
    if r.get("attention_ran"):
        bits.append("ran: " + ", ".join(f"{k.split('.')[1]} x{n}"
                                        for k, n in sorted(r["attention_ran"].items())))
    if r.get("attention_fallbacks"):
        bits.append(f"fallbacks {r['attention_fallbacks']}")
    return "; ".join(bits)


def _speed_table(parts: dict) -> list[str]:
    rows = [("meshplan", "speed_meshplan"), ("eager PyTorch", "speed_eager"),
            ("torch.compile (each block)", "speed_compile"),
            ("meshplan, --kernels inductor", "speed_inductor")]
    have = [(label, parts[n]["result"]) for label, n in rows
            if n in parts and "step_s" in parts[n].get("result", {})]
    if not have:
        return []
    c = have[0][1]["config"]
    out = ["", f"## Speed: GPT {have[0][1]['params'] / 1e9:.2f}B parameters "
           f"({c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, seq "
           f"{c['seq_len']}, vocab {c['vocab']}, batch {c['batch']}), bf16, AdamW, one device",
           "", "Model FLOPs per step = 6 x params x tokens + 12 x layers x hidden x seq x "
           "tokens (attention, full square).", "",
           "| run | step (ms) | tokens/s | TFLOP/s | of peak | peak memory planned / measured "
           "(GiB) |", "|---|---:|---:|---:|---:|---|"]
    for label, r in have:
        frac = f"{r['fraction_of_peak']:.1%}" if r.get("fraction_of_peak") else "-"
        out.append(f"| {label} | {r['step_s'] * 1e3:.1f} | {r['tokens'] / r['step_s']:,.0f} | "
                   f"{r['tflops']:.1f} | {frac} | {_gib(r.get('planned_peak_bytes'))} / "
                   f"{_gib(r.get('measured_peak_bytes'))} |")
    by = dict(have)
    mine, eager = by.get("meshplan"), by.get("eager PyTorch")
    out.append("")
    if mine and eager:
        ratio = mine["step_s"] / eager["step_s"]
        met = "met" if ratio <= MAX_RATIO_TO_EAGER else "NOT met"
        out.append(f"- meshplan / eager step time: {ratio:.3f} (target <= "
                   f"{MAX_RATIO_TO_EAGER}: {met})")
    if mine and mine.get("fraction_of_peak"):
        met = "met" if mine["fraction_of_peak"] >= MIN_FRACTION_OF_PEAK else "NOT met"
        out.append(f"- meshplan fraction of bf16 peak ({mine['peak_tflops']:.0f} TFLOP/s): "
                   f"{mine['fraction_of_peak']:.1%} (target >= {MIN_FRACTION_OF_PEAK:.0%}: "
                   f"{met})")
    if mine and mine.get("measured_peak_bytes") and mine.get("planned_peak_bytes"):
        planned, measured = mine["planned_peak_bytes"], mine["measured_peak_bytes"]
        out.append(f"- meshplan memory: planned {_gib(planned)} GiB, measured (allocator) "
                   f"{_gib(measured)} GiB, measured / planned {measured / planned:.2f}")
    fused, compiled = by.get("meshplan, --kernels inductor"), by.get("torch.compile (each block)")
    if fused and compiled:
        ratio = fused["step_s"] / compiled["step_s"]
        out.append(f"- meshplan --kernels inductor / torch.compile step time: {ratio:.3f} "
                   f"(issue 39's target <= 1.0: {'met' if ratio <= 1.0 else 'NOT met'})")
    if fused and fused.get("fraction_of_peak") and compiled and \
            compiled.get("fraction_of_peak"):
        met = "met" if fused["fraction_of_peak"] >= compiled["fraction_of_peak"] else "NOT met"
        out.append(f"- meshplan --kernels inductor fraction of peak: "
                   f"{fused['fraction_of_peak']:.1%} (target >= torch.compile's "
                   f"{compiled['fraction_of_peak']:.1%}: {met}); Inductor compile "
                   f"{fused.get('kernel_compile_s', 0):.1f} s at its first step")
    backend = by.get("torch.compile (each block)", {}).get("compile_backend")
    if backend:
        out.append(f"- torch.compile: every transformer block compiled ({backend}; regional "
                   "compilation, one graph shared by all blocks), embeddings, head and loss "
                   "eager; its compiling steps are warm-up, not in the median")
    return out


def _profile(parts: dict) -> list[str]:
    r = parts.get("speed_profile", {}).get("result", {}) | \
        parts.get("profile_inductor", {}).get("result", {})
    out = []
    for name in ("meshplan", "eager", "meshplan inductor", "torch.compile"):
        if name not in r:
            continue
        x = r[name]
        if not out:
            out += ["", "## Where the time goes (one profiled step)", ""]
        busy = x["device_busy_ms"] / x["wall_ms"] if x["wall_ms"] else 0.0
        pace = ("the GPU sets the pace" if busy >= 0.9 else
                "the host leaves the GPU idle for part of the step")
        kinds = x.get("device_by_kind_ms", {})
        out.append(f"**{name}**: wall {x['wall_ms']:.1f} ms, GPU busy "
                   f"{x['device_busy_ms']:.1f} ms ({busy:.0%}: {pace}); device time by kind: "
                   + ", ".join(f"{k} {v:.1f} ms" for k, v in kinds.items()))
        out += ["", "| top kernels | calls | ms |", "|---|---:|---:|"]
        out += [f"| `{k[:70]}` | {n} | {ms:.2f} |" for k, n, ms in x["top_device"][:10]]
        out += ["", "| top host ops | calls | ms |", "|---|---:|---:|"]
        out += [f"| `{k[:70]}` | {n} | {ms:.2f} |" for k, n, ms in x["top_cpu"][:8]]
        out.append("")
    return out


def write_report(report: dict, out: Path) -> None:
    """Write `out/gpu.json` and `out/gpu.md`."""
    _write(out / "gpu.json", json.dumps(report, indent=1, default=str))
    env, parts = report["environment"], report["parts"]
    ok = sum(1 for p in parts.values() if p["status"] == "ok")
    lines = ["# GPU check" + (" (CPU dry run: small model, not a GPU result)"
                              if report["dry_run"] else ""), "",
             f"{env['date']}: {env.get('gpu', 'cpu')} "
             f"({env.get('gpu_memory_gib', '-')} GiB), torch {env['torch']}, CUDA "
             f"{env['cuda']}, Python {env['python']}, commit {env.get('commit') or '?'}.",
             f"Written by `PYTHONPATH=. python benchmarks/gpu_check.py`: {ok}/{len(parts)} "
             f"parts ok in {report.get('total_s', 0):.0f} s (budget {report['budget_s']:.0f} s).",
             "", "| part | status | s | judged | result |", "|---|---|---:|---|---|"]
    for name, p in parts.items():
        judged = p.get("result", {}).get("judged", "")
        cells = [name, p["status"], f"{p['seconds']:.0f}", judged, _summary(p)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += _speed_table(parts)
    lines += _profile(parts)
    bad = {n: p for n, p in parts.items() if p["status"] not in ("ok", "skipped")}
    if bad:
        lines += ["", "## Output of the parts that did not pass", ""]
        for name, p in bad.items():
            lines += [f"### {name} ({p['status']}, exit code {p.get('exit_code')})", "", "```"]
            lines += p.get("log_tail", [])[-30:] + ["```", ""]
    _write(out / "gpu.md", "\n".join(lines) + "\n")
