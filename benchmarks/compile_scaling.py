"""Compile scaling: how compile time grows with the model and the cluster.

1. GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048, vocab 50304) on
   tp=8, pp=16, vpp=2, 64 micro-batches, for dp in {1, 4, 8, 32} (world
   128 ... 4096). Capture runs once (meta device, no weights). Per world:
   master seconds (autodiff + planning passes; target <= 1 s) and per-rank
   lowering seconds over a sample of ranks (target <= 0.3 s, and at 4096
   ranks <= 1.2 x at 128).
2. ResNet-50 data parallel on 1, 4, 16, 128 ranks: master + lowering every
   rank (2 worker processes); target <= 1 s at 16 ranks. Temp-size inference
   must run once per distinct signature: its calls and cache hits are shown.
3. Uneven boxing, a stage of 3 ranks -> a stage of 5 ranks on a large
   activation: pieces (= send/recv tasks) per rank stay O(peers).

Run: python benchmarks/compile_scaling.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write  # noqa: E402

from meshplan.autodiff import build_train_step  # noqa: E402
from meshplan.capture import capture  # noqa: E402
from meshplan.driver.compile import compile_job  # noqa: E402
from meshplan.driver.plan import capture_zoo, plan_model, zoo_strategy  # noqa: E402
from meshplan.ir.mesh import Mesh, Placement  # noqa: E402
from meshplan.ir.pieces import recv_pieces, send_pieces  # noqa: E402
from meshplan.ir.sbp import Replicate, Shard  # noqa: E402
from meshplan.models import build_model, example_batch, model_config  # noqa: E402
from meshplan.ops.temp import TempStats  # noqa: E402
from meshplan.passes.plan import plan_job  # noqa: E402
from meshplan.plan.lower import lower  # noqa: E402


def _sample(world: int) -> list[int]:
    """A few ranks spread over the cluster: first, middle and last stages."""
    return sorted({0, 3, world // 2 + 5, world - 1})


def gpt_rows() -> tuple[float, list[dict]]:
    cfg = model_config("gpt", "gpt3-175b")
    t0 = time.perf_counter()
    graph = capture(build_model(cfg, device="meta"), example_batch(cfg, 1, device="meta"))
    capture_s = time.perf_counter() - t0
    rows = []
    for dp in (1, 4, 8, 32):
        world = dp * 8 * 16
        s = zoo_strategy("gpt", cfg, dp=dp, tp=8, pp=16, vpp=2,
                         global_batch_size=64 * dp, micro_batch_size=1)
        t1 = time.perf_counter()
        step = build_train_step(graph, num_microbatches=s.num_microbatches)
        autodiff_s = time.perf_counter() - t1
        timings: dict = {}
        t2 = time.perf_counter()
        job = plan_job(step, Mesh(world // 8, 8), s, timings=timings)
        passes_s = time.perf_counter() - t2
        digest = job.digest()
        lowers = {}
        for r in _sample(world):
            best = float("inf")
            for _ in range(3):  # best of 3: single lowerings take ~50 ms, noise is large
                t3 = time.perf_counter()
                plan = lower(job, r, job_digest=digest)
                best = min(best, time.perf_counter() - t3)
            lowers[r] = (best, len(plan.tasks))
        times = sorted(v[0] for v in lowers.values())
        rows.append({"world": world, "dp": dp, "ops": len(job.graph.ops),
                     "master_s": autodiff_s + passes_s, "autodiff_s": autodiff_s,
                     "passes_s": passes_s, "per_pass_s": timings,
                     "lower_median_s": statistics.median(times), "lower_max_s": times[-1],
                     "tasks_per_rank": {str(r): v[1] for r, v in lowers.items()}})
    return capture_s, rows


def resnet_rows(tmp: Path) -> list[dict]:
    cfg = model_config("resnet", "resnet50")
    t0 = time.perf_counter()
    capture_zoo(cfg, 8)
    first_capture_s = time.perf_counter() - t0
    rows = []
    for world in (1, 4, 16, 128):
        TempStats.calls = TempStats.misses = 0
        s = zoo_strategy("resnet", cfg, dp=world, global_batch_size=8 * world,
                         micro_batch_size=8)
        t1 = time.perf_counter()
        planned = plan_model("resnet", "resnet50", Mesh(1, world), s)
        t2 = time.perf_counter()
        stats = compile_job(planned.job, tmp / f"resnet{world}", workers=2, use_cache=False)
        t3 = time.perf_counter()
        rows.append({"world": world, "capture_s": planned.capture_s,
                     "master_s": t2 - t1 - planned.capture_s, "lower_all_s": t3 - t2,
                     "total_s": t3 - t1, "temp_inference": stats["temp_inference"],
                     "first_capture_s": first_capture_s})
    return rows


def uneven_rows() -> list[dict]:
    shape = (8, 2048, 12288)  # one micro-batch of GPT-3 activations
    src, dst = Placement((0, 1, 2), (3,)), Placement((3, 4, 5, 6, 7), (5,))
    rows = []
    for name, dst_sbp in (("S(0)->S(0)", (Shard(0),)), ("S(0)->R", (Replicate(),))):
        t0 = time.perf_counter()
        sends = {r: len(send_pieces(shape, src, (Shard(0),), dst, dst_sbp, r)) for r in src.ranks}
        recvs = {r: len(recv_pieces(shape, src, (Shard(0),), dst, dst_sbp, r))
                 for r in dst.ranks}
        rows.append({"case": name, "sends_per_src_rank": sends, "recvs_per_dst_rank": recvs,
                     "seconds": time.perf_counter() - t0})
    return rows


def main() -> None:
    capture_s, gpt = gpt_rows()
    with tempfile.TemporaryDirectory() as tmp:
        resnet = resnet_rows(Path(tmp))
    uneven = uneven_rows()
    base, top = gpt[0]["lower_max_s"], gpt[-1]["lower_max_s"]
    base_dp = gpt[1]["lower_max_s"]  # world 512: the smallest world with dp traffic
    result = {"benchmark": "compile_scaling", "machine": machine(),
              "gpt3_175b": {"capture_s": capture_s, "rows": gpt,
                            "targets": {"master_s": 1.0, "lower_s": 0.3,
                                        "lower_4096_over_128": 1.2},
                            "lower_4096_over_128": top / base,
                            "lower_4096_over_512": top / base_dp},
              "resnet50": {"rows": resnet, "target_total_s_at_16": 1.0},
              "uneven_boxing": uneven}
    lines = [f"GPT-3 175B, tp=8 pp=16 vpp=2, 64 micro-batches (capture once on the meta "
             f"device: {capture_s:.1f} s).", "",
             "| world | dp | ops in Job | master (s) | passes (s) | lower median (s) "
             "| lower max (s) |", "|---|---|---|---|---|---|---|"]
    for r in gpt:
        lines.append(f"| {r['world']} | {r['dp']} | {r['ops']} | {r['master_s']:.3f} | "
                     f"{r['passes_s']:.3f} | {r['lower_median_s']:.3f} | "
                     f"{r['lower_max_s']:.3f} |")
    lines += ["", f"Per-rank lowering at 4096 ranks / at 128: {top / base:.2f} (target <= 1.2); "
              f"/ at 512: {top / base_dp:.2f}. World 128 has dp=1, so its ranks have no "
              "gradient all-reduce tasks (7598 vs 9721 Job ops): part of the gap is work "
              "that only exists with dp > 1, not growth with the cluster.",
              "", "ResNet-50, data parallel (capture cached after the first: "
              f"{resnet[0]['first_capture_s']:.1f} s).", "",
              "| ranks | master (s) | lower all ranks, 2 workers (s) | total (s) "
              "| temp inference calls / cache hits |", "|---|---|---|---|---|"]
    for r in resnet:
        ti = r["temp_inference"]
        lines.append(f"| {r['world']} | {r['master_s']:.3f} | {r['lower_all_s']:.3f} | "
                     f"{r['total_s'] - r['capture_s']:.3f} | {ti['calls']} / "
                     f"{ti['cache_hits']} |")
    lines += ["", "Uneven boxing, 3 ranks -> 5 ranks, activation (8, 2048, 12288):", ""]
    for r in uneven:
        lines.append(f"- {r['case']}: sends per source rank {r['sends_per_src_rank']}, "
                     f"receives per destination rank {r['recvs_per_dst_rank']}")
    write("compile_scaling", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
