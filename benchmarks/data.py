"""Real-data reading: its time beside a training step, and its memory
against the size of the token file.

Time: GPT small (seq_len 128, vocab 1024) at dp2*pp2 with micro_batch_size
4 and 4 micro-batches: a rank reads 16 samples a step (global batch 32, its
data-parallel half: rows 0-3 of each micro-batch of 8). What the rank runs,
`FeedReader.microbatches(step, rows)` (a read per micro-batch, then the
model's (inputs, labels)), is timed against one eager forward+backward+AdamW step of GPT small on 16
samples, alternated so that machine noise hits both; the ratio is
read / step (target <= 2%). The token file is warm in the page cache (it was
just written): this times the reader, not the disk.

Memory: two fresh processes read the same 200 steps of shuffled samples,
one from a file of N tokens, one of 10N; each reports its peak RSS and, at
the end, its anonymous and file-backed resident memory (/proc/self/status).
The peak is `VmHWM`, the new process's own high-water mark: `ru_maxrss`
(also recorded) keeps the parent's peak across exec (Linux folds the old
mm's high-water mark into the signal's maxrss), so the memory part runs
first, before this process builds a model. The order takes O(1) memory, and
the reader unmaps the file pages it read after each read
(`TokenData.release`): without that, the kernel's fault-around maps whole
cached folios around each read and the 10N process ended with ~380 MiB of
its file resident (measured on this machine's kernel; MADV_RANDOM did not
stop it), so both peaks should agree within a few MB.

Run: python benchmarks/data.py [--tokens 20000000] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, median, write  # noqa: E402
from meshplan.data.feed import FeedReader, TokenFeed  # noqa: E402
from meshplan.data.tokens import TokenWriter  # noqa: E402
from meshplan.models import build_model, example_batch, model_config  # noqa: E402

SEQ_LEN, VOCAB, DOC_LEN = 128, 1024, 4096
GLOBAL_BATCH, RANK_SAMPLES = 32, 16  # dp2 x micro_batch_size 4 x 4 micro-batches
MICROBATCHES, ROWS = 4, (0, 4)  # dp rank 0's rows of each micro-batch of 8
MiB = 2 ** 20


def make_token_dir(path: Path, n_tokens: int) -> None:
    """A token directory of `n_tokens` random uint16 ids below VOCAB, a
    document every DOC_LEN tokens, written in chunks (no n_tokens array)."""
    path.mkdir(parents=True)
    with TokenWriter(path, VOCAB, VOCAB - 1) as w:
        w.finish({"kind": "bytes"}, ["random"], 0.0)  # index of an empty train split
    rng = np.random.default_rng(0)
    chunk = 1 << 22  # a multiple of DOC_LEN
    with open(path / "train.bin", "wb") as f:
        for start in range(0, n_tokens, chunk):
            arr = rng.integers(0, VOCAB - 1, min(chunk, n_tokens - start), dtype=np.uint16)
            arr[DOC_LEN - 1::DOC_LEN] = VOCAB - 1
            arr.tofile(f)
    index = json.loads((path / "index.json").read_text())
    docs = -(-n_tokens // DOC_LEN)
    index["splits"]["train"] = {"documents": docs, "tokens": n_tokens,
                                "longest_document": min(DOC_LEN, n_tokens)}
    (path / "index.json").write_text(json.dumps(index))


def rank_reader(data_dir) -> FeedReader:
    """The reader a dp2*pp2 rank of the first stage opens."""
    return FeedReader(TokenFeed(str(data_dir), "train", SEQ_LEN, 0), GLOBAL_BATCH, MICROBATCHES)


def time_reader_and_step(data_dir: Path, steps: int, reads_per_step: int) -> dict:
    cfg = model_config("gpt", "small")
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = example_batch(cfg, RANK_SAMPLES)
    reader = rank_reader(data_dir)
    read_s, step_s, k = [], [], 0
    for i in range(steps + 2):
        for _ in range(reads_per_step):
            t0 = time.perf_counter()
            mbs = reader.microbatches(k, ROWS)
            read_s.append(time.perf_counter() - t0)
            k += 1
        assert sum(x.shape[0] for x, _ in mbs) == RANK_SAMPLES
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(*batch).backward()
        opt.step()
        if i >= 2:  # warm-up steps
            step_s.append(time.perf_counter() - t0)
    read_s = read_s[2 * reads_per_step:]
    return {"model": "gpt-small", "samples_per_step": RANK_SAMPLES, "seq_len": SEQ_LEN,
            "reads": len(read_s), "steps": len(step_s), "read_s": median(read_s),
            "step_s": median(step_s), "ratio": median(read_s) / median(step_s),
            "rows_read": reader.rows_read}


def child(data_dir: str, steps: int) -> None:
    """In a fresh process: read `steps` shuffled steps; print the memory as JSON."""
    reader = rank_reader(data_dir)
    total = 0
    for s in range(steps):
        total += sum(int(x.sum()) for x, _ in reader.microbatches(s, ROWS))
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text()
                  .splitlines() if ":" in line)
    kb = lambda key: int(status.get(key, "0 kB").split()[0]) * 1024  # noqa: E731
    print(json.dumps({"tokens": len(reader.data.tokens), "steps": steps,
                      "rows_read": reader.rows_read, "checksum": total,
                      "peak_rss": kb("VmHWM"),
                      "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "rss_anon": kb("RssAnon"), "rss_file": kb("RssFile")}))


def memory(tmp: Path, n_tokens: int, steps: int) -> list[dict]:
    rows = []
    for n in (n_tokens, 10 * n_tokens):
        d = tmp / f"tokens-{n}"
        make_token_dir(d, n)
        out = subprocess.run([sys.executable, __file__, "--child", str(d), "--steps", str(steps)],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out))
        shutil.rmtree(d)
    return rows


def table(timing: dict, mem: list[dict]) -> str:
    lines = [f"Data reading, GPT small (seq_len {SEQ_LEN}), a dp2*pp2 rank's "
             f"{RANK_SAMPLES} samples a step; median of {timing['reads']} shuffled reads and "
             f"{timing['steps']} eager AdamW steps, alternated; target ratio <= 0.02.", "",
             "| read a step (ms) | train a step (ms) | ratio |", "|---|---|---|",
             f"| {timing['read_s'] * 1e3:.3f} | {timing['step_s'] * 1e3:.1f} | "
             f"{timing['ratio']:.5f} |", "",
             f"Memory: fresh processes, each reading {mem[0]['steps']} steps "
             f"({mem[0]['rows_read']} shuffled samples).", "",
             "| token file | peak RSS, VmHWM (MiB) | anonymous at end (MiB) | "
             "file-backed at end (MiB) |", "|---|---|---|---|"]
    for m in mem:
        lines.append(f"| {m['tokens'] / 1e6:.0f}M uint16 ({m['tokens'] * 2 / MiB:.0f} MiB) | "
                     f"{m['peak_rss'] / MiB:.1f} | {m['rss_anon'] / MiB:.1f} | "
                     f"{m['rss_file'] / MiB:.1f} |")
    diff = lambda key: (mem[1][key] - mem[0][key]) / MiB  # noqa: E731
    lines += ["", f"10N - N: peak RSS {diff('peak_rss'):+.1f} MiB, anonymous "
              f"{diff('rss_anon'):+.1f} MiB, file-backed {diff('rss_file'):+.1f} MiB."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--steps", type=int, default=30, help="timed training steps")
    ap.add_argument("--memory-steps", type=int, default=200)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.memory_steps if a.steps == 30 else a.steps)
    with tempfile.TemporaryDirectory(prefix="meshplan-bench-data-") as t:
        tmp = Path(t)
        mem = memory(tmp, a.tokens, a.memory_steps)
        make_token_dir(tmp / "timing", a.tokens)
        timing = time_reader_and_step(tmp / "timing", a.steps, reads_per_step=20)
        shutil.rmtree(tmp / "timing")
    result = {"benchmark": "data", "target_ratio": 0.02, "machine": machine(),
              "timing": timing, "memory": mem,
              "difference_bytes": {k: mem[1][k] - mem[0][k]
                                   for k in ("peak_rss", "rss_anon", "rss_file")}}
    write("data", result, table(timing, mem))


if __name__ == "__main__":
    main()
