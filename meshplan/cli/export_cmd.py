"""The `export` verb: a checkpoint's weights for transformers or torch.

Invariant: every mistake (no such checkpoint, an incomplete or damaged one,
`--format hf` of a model transformers does not build, an --out in use) is
one line, exit 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import json

from meshplan.driver.export import (
    DEFAULT_SHARD_SIZE,
    ExportFormat,
    check_out,
    checkpoint_source,
    export,
)
from meshplan.driver.weights_out import parse_size

EPILOG = """examples:
  meshplan export run/ --format hf --out gpt2-export/          # run/'s newest checkpoint
  meshplan export run/checkpoints/step_40 --format torch --out weights/
  meshplan export run/ --format hf --out big/ --max-shard-size 200MB"""


def add_export_flags(p: argparse.ArgumentParser) -> None:
    """The export verb's arguments."""
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint directory (RUN/checkpoints/step_K) or a run directory "
                   "(its newest complete checkpoint)")
    p.add_argument("--format", required=True, choices=[f.value for f in ExportFormat],
                   help="hf: transformers' from_pretrained directory (config.json, "
                   "safetensors, tokenizer); torch: state dicts of the trained module's names")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="a new (or empty) directory to write")
    p.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE, metavar="SIZE",
                   help=f"largest weights file, e.g. 200MB or 10GB (default {DEFAULT_SHARD_SIZE}"
                   "); more weights than that are split into shards with an index")


def cmd_export(a: argparse.Namespace) -> int:
    """Run `export`: check everything, write --out, print what was written."""
    parse_size(a.max_shard_size)
    check_out(a.out)
    source = checkpoint_source(a.checkpoint)
    r = export(source, ExportFormat(a.format), a.out, a.max_shard_size)
    if a.json:
        print(json.dumps({"checkpoint": source.where, "out": r.out, "files": list(r.files),
                          "tensors": r.tensors, "bytes": r.bytes, "seconds": r.seconds,
                          "notes": list(r.notes)}))
        return 0
    print(export_lines(source.where, a.format, r))
    return 0


def export_lines(where: str, fmt: str, r) -> str:
    """What an export wrote, for people."""
    lines = [f"exported {where} as {fmt}: {r.tensors} tensors, {r.bytes / 2**20:.1f} MiB in "
             f"{r.seconds:.1f} s -> {r.out}/: {', '.join(r.files)}"]
    return "\n".join(lines + [f"note: {n}" for n in r.notes])
