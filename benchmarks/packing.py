"""`train --pack` against one pair a row: the same short pairs (a line of the
`json` package's sources, its first 24 characters, and in upper case), the
same model (`--hf llama --size tiny`, one process, `--seq-len 128`);
packed for the same epochs (fewer steps), and for the same steps (more
epochs); alternating runs. Reports each run's wall time, pairs a second,
the rows' fill, and the eval loss at the end (each on the validation split
as it trains: packed rows compute what lone ones do).

    python benchmarks/packing.py [--rounds 2] [--epochs 3]

Writes benchmarks/results/packing.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from tests.token_data import pairs_jsonl  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GBS, SEQ, PAIRS = 16, 128, 480


def _run(data: str, out: str, steps: int, pack: bool) -> dict:
    cmd = [sys.executable, "-m", "meshplan", "-q", "train", "--hf", "llama", "--size", "tiny",
           "--data", data, "--out", out, "--seq-len", str(SEQ), "--devices-per-node", "1",
           "--tp", "1", "--pp", "1", "--vpp", "1", "--global-batch-size", str(GBS),
           "--micro-batch-size", str(GBS), "--steps", str(steps), "--eval-every", str(steps),
           "--eval-batches", "1", "--warmup-steps", "0", "--lr-schedule", "constant",
           "--lr", "3e-3", "--sample-tokens", "0", "--json", *(["--pack"] if pack else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    a = ap.parse_args()
    from meshplan.data.feed import Layout, TokenFeed
    from meshplan.driver.train_model import pack_fill

    with tempfile.TemporaryDirectory(prefix="packing-") as tmp:
        rows = pairs_jsonl(Path(tmp) / "full.jsonl", PAIRS)
        short = [{"text": r["text"][:24], "target": r["target"][:24]} for r in rows]
        (Path(tmp) / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in short))
        data = f"{tmp}/data"
        subprocess.run([sys.executable, "-m", "meshplan", "-q", "prepare-data", "--input",
                        f"{tmp}/pairs.jsonl", "--target-field", "target", "--val-fraction",
                        "0.1", "--out", data], check=True, capture_output=True)
        fill = pack_fill(TokenFeed(data, "train", SEQ, 0, Layout.PACKED_SHIFTED))
        from meshplan.data.tokens import TokenData

        n = TokenData(data, "train").documents
        one = a.epochs * n // GBS
        kinds = {"one pair a row": (one, False, a.epochs),
                 "`--pack`, the same epochs": (round(one / fill["pairs_per_row"]), True,
                                               a.epochs),
                 "`--pack`, the same steps": (one, True, a.epochs * fill["pairs_per_row"])}
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        for r in range(a.rounds):
            for kind in list(kinds) if r % 2 == 0 else list(kinds)[::-1]:
                steps, pack, epochs = kinds[kind]
                s = _run(data, f"{tmp}/run_{len(runs[kind])}_{r}", steps, pack)
                runs[kind].append({"wall_s": s["wall_s"], "eval": s["evals"][-1][1],
                                   "pairs_per_s": epochs * n / s["wall_s"]})
                print(f"{kind} round {r}: {runs[kind][-1]}", flush=True)
    best = {k: min(v, key=lambda x: x["wall_s"]) for k, v in runs.items()}
    out = {"pairs": n, "seq_len": SEQ, "global_batch_size": GBS, "epochs": a.epochs,
           "kinds": {k: {"steps": s, "pack": p, "epochs": e} for k, (s, p, e) in kinds.items()},
           "fill": fill, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "packing.json").write_text(json.dumps(out, indent=1) + "\n")
    names = list(kinds)
    speed = best[names[0]]["wall_s"] / best[names[1]]["wall_s"]
    lines = ["# `train --pack` against one pair a row", "",
             f"`benchmarks/packing.py`: {n} training pairs (a line's first 24 characters and "
             f"it in upper case), `--hf llama --size tiny`, one process, `--seq-len {SEQ}`, "
             f"global batch {GBS} rows, AdamW at a constant 3e-3; {a.rounds} alternating "
             "rounds, the faster of each kept. 2 CPUs.", "",
             "| rows | steps | epochs | pairs a row | filled | wall (s) | pairs/s | eval loss |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, (steps, pack, epochs) in kinds.items():
        per_row = fill["pairs_per_row"] if pack else 1.0
        filled = fill["filled"] if pack else fill["filled"] / fill["pairs_per_row"]
        lines.append(f"| {kind} | {steps} | {epochs:.1f} | {per_row:.2f} | {filled:.1%} | "
                     f"{best[kind]['wall_s']:.1f} | {best[kind]['pairs_per_s']:.0f} | "
                     f"{best[kind]['eval']:.3f} |")
    lines += ["", f"- The same epochs packed: {speed:.2f}x as fast, in fewer, larger steps "
              "(each averages over more target tokens).",
              f"- The same steps packed: about the same wall time, {kinds[names[2]][2]:.1f} "
              f"epochs instead of {a.epochs}, eval loss {best[names[2]]['eval']:.3f} against "
              f"{best[names[0]]['eval']:.3f}."]
    (RESULTS / "packing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
