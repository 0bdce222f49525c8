"""What a checkpoint costs a training step: none, synchronous, async.

The main job's model and layout (GPT small, dp2 tp2 pp2 vpp2 on 8 local
processes, the standard library's bytes) under `train_job`, a checkpoint
every `EVERY` steps, in three modes run alternately, round after round
(`common.alternate`), so that load from other processes on the machine
spreads over all three:
- `none`: no checkpoints;
- `sync`: `--checkpoint-every`, training waits for the save;
- `async`: `--async-checkpoint`, the ranks stage host copies and train on.

A step's time here is the wall time from one step's end to the next's, as
the launching process sees it (`train_job`'s `on_step`, polled every 50 ms):
unlike the metrics' `step_s`, it includes the save, and in async mode the
background write's contention with the next step. A step that saves is
compared with the same step of the `none` run; the cost of one checkpoint is
the steps from the first save to the end, summed, minus the same steps of
`none`, per checkpoint: what the run as a whole paid for it. Step 1 (warm-up)
is left out.

Run: python benchmarks/checkpoint.py [--rounds 2] [--steps 9]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import alternate, machine, median, write  # noqa: E402

EVERY = 2
MODES = ("none", "sync", "async")


def main_job(steps: int):
    """The main job's Job, weights and training feed (the CLI's defaults)."""
    from meshplan.cli import train_cmd as t
    from meshplan.cli.main import build_parser
    from meshplan.cli.progress import Progress
    from meshplan.data.feed import TokenFeed

    a = build_parser().parse_args(["-q", "train", "--steps", str(steps), "--warmup-steps", "2",
                                   "--eval-every", "0",
                                   "--sample-tokens", "0"])
    a.progress = Progress(quiet=True)
    a = t._resolved(a)
    data_dir = t.default_corpus(a.progress)
    lm = t._language_model(a, data_dir)
    return lm, TokenFeed(data_dir, "train", lm.seq_len, a.seed, lm.layout)


def one_run(lm, feed, steps: int, mode: str, tmp: Path) -> dict:
    """One training run: each step's wall time (step k: from step k-1's end
    to its own, as `on_step` sees them) and the checkpoint's size."""
    from meshplan.driver.train import train_job
    from meshplan.runtime.state import weights_of

    out = tmp / mode
    shutil.rmtree(out, ignore_errors=True)
    seen: dict[int, float] = {}
    train_job(lm.job, weights_of(lm.module), feed, steps, str(out),
              checkpoint_every=0 if mode == "none" else EVERY, keep=1,
              async_checkpoint=mode == "async", tensorboard=False,
              on_step=lambda k: seen.setdefault(k, time.perf_counter()))
    step_s = {k: seen[k] - seen[k - 1] for k in seen if k - 1 in seen}
    size = 0
    if mode != "none":
        newest = max((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
        size = sum(f.stat().st_size for f in newest.iterdir())
    shutil.rmtree(out, ignore_errors=True)
    return {"step_s": step_s, "bytes": size}


def summary(rounds: dict, steps: int) -> dict:
    """Per mode: the median time of steps that save and of those that do
    not, and the cost of one checkpoint against `none` (seconds and share
    of a step)."""
    saves = [k for k in range(2, steps + 1) if k % EVERY == 0]
    rest = [k for k in range(2, steps + 1) if k % EVERY != 0]
    span = list(range(saves[0], steps + 1))

    def times(mode: str, ks: list[int]) -> list[float]:
        return [r["step_s"][k] for r in rounds[mode]["rounds"] for k in ks if k in r["step_s"]]

    base_step = median(times("none", rest + saves))
    base_span = median([sum(r["step_s"].get(k, 0.0) for k in span)
                        for r in rounds["none"]["rounds"]])
    out = {}
    for mode in MODES:
        spent = median([sum(r["step_s"].get(k, 0.0) for k in span)
                        for r in rounds[mode]["rounds"]])
        cost = (spent - base_span) / len(saves)
        out[mode] = {"saving_step_s": median(times(mode, saves)),
                     "other_step_s": median(times(mode, rest)),
                     "cost_per_checkpoint_s": cost if mode != "none" else 0.0,
                     "cost_share_of_step": cost / base_step if mode != "none" else 0.0,
                     "checkpoint_bytes": rounds[mode]["rounds"][0]["bytes"]}
    out["step_s_none"] = base_step
    return out


def table(s: dict, steps: int, rounds: int, busy: float = 0.0) -> str:
    noisy = (f" The CPUs were {busy:.0%} busy before the runs (other processes): the "
             "figures are noisy; rerun on a quiet machine to tighten them.") if busy > 0.5 else ""
    head = (f"GPT small (the main job: dp2 tp2 pp2 vpp2, 8 local processes, global batch 16) "
            f"for {steps} steps, a checkpoint every {EVERY}, the three modes alternated over "
            f"{rounds} rounds. A step's time is from the previous step's end to its own, as the "
            "launching process sees it (50 ms polls), save included. Cost per checkpoint: the "
            "steps from the first save to the end, minus the same steps without "
            f"checkpoints, per save.{noisy}\n\n"
            "| mode | step that saves (ms) | other steps (ms) | cost per checkpoint (ms) "
            "| % of a step | checkpoint size (MiB) |\n|---|---|---|---|---|---|\n")
    rows = [f"| {m} | {s[m]['saving_step_s'] * 1e3:.0f} | {s[m]['other_step_s'] * 1e3:.0f} "
            f"| {s[m]['cost_per_checkpoint_s'] * 1e3:.0f} "
            f"| {s[m]['cost_share_of_step']:.1%} | {s[m]['checkpoint_bytes'] / 2 ** 20:.1f} |"
            for m in MODES]
    return head + "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=9)
    a = p.parse_args()
    t0 = time.perf_counter()
    lm, feed = main_job(a.steps)
    with tempfile.TemporaryDirectory(prefix="meshplan-bench-ckpt-") as tmp:
        runs = {m: (lambda m=m: one_run(lm, feed, a.steps, m, Path(tmp))) for m in MODES}
        rounds = alternate(runs, a.rounds)
    s = summary(rounds, a.steps)
    result = {"machine": machine(), "steps": a.steps, "every": EVERY, "rounds": a.rounds,
              "summary": s, "wall_s": time.perf_counter() - t0,
              "runs": {m: [{"step_s": {str(k): v for k, v in r["step_s"].items()},
                            "bytes": r["bytes"]} for r in rounds[m]["rounds"]]
                       for m in MODES},
              "busy_before": {m: rounds[m]["busy_before"] for m in MODES}}
    busy = median([b for m in MODES for b in rounds[m]["busy_before"]])
    write("checkpoint", result, table(s, a.steps, a.rounds, busy))


if __name__ == "__main__":
    main()
