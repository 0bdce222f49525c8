"""The `prepare-data` verb: text files or a local HF dataset into a token
directory (`meshplan/data/`) that `meshplan train` reads.

Invariants:
- It needs no network: a BPE is trained here, a transformers tokenizer or
  a dataset is read from a local directory only.
- Stdout is a short summary, or with `--json` one JSON object (the
  directory's index); progress (files done) goes to stderr.
- A user mistake is one ConfigError line and leaves no output behind
  (`prepare_data` writes to a temporary directory renamed into place).
"""

from __future__ import annotations

import argparse
import json

from meshplan.data import expand_inputs, prepare_data
from meshplan.errors import ConfigError

EPILOG = """examples:
  meshplan prepare-data --input 'corpus/**/*.txt' --out data/corpus
  meshplan prepare-data --input shards/*.jsonl --text-field body --tokenizer bpe:8192 --out data/b
  meshplan prepare-data --hf-dataset saved/wikitext --tokenizer ./gpt2-tokenizer --out data/w
  meshplan prepare-data --input pairs.jsonl --text-field en --target-field fr --out data/en-fr"""


def add_prepare_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `prepare-data`."""
    p.add_argument("--input", nargs="+", metavar="GLOB", default=None,
                   help="input files or globs (quoted for `**`); .jsonl: one document per "
                   "line, any other file: one document (required unless --hf-dataset)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="token directory to write (a new or empty directory, or an old "
                   "token directory to replace)")
    p.add_argument("--tokenizer", default="bytes",
                   help="bytes (default: UTF-8 bytes, vocab 257), bpe:VOCAB (a byte-level BPE "
                   "trained on the inputs, e.g. bpe:4096) or a local transformers tokenizer "
                   "directory")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="fraction of documents for the validation split, in [0, 1) "
                   "(default 0.05)")
    p.add_argument("--text-field", default="text",
                   help="the JSON field (.jsonl) or dataset column holding the text "
                   "(default text)")
    p.add_argument("--target-field", default=None, metavar="FIELD",
                   help="paired data (a translation, a summary, a prompt's answer): the JSON "
                   "field or column of each row's target, --text-field being its source; "
                   "`meshplan train` then learns the target from the source")
    p.add_argument("--hf-dataset", default=None, metavar="PATH",
                   help="a local Hugging Face dataset (save_to_disk directory or data files) "
                   "instead of --input")


def summary_lines(index: dict, out: str) -> list[str]:
    """The human summary of a prepared directory's index."""
    tok = index["tokenizer"]
    name = {"bytes": "bytes", "bpe": f"bpe:{tok.get('vocab_size')}"}.get(tok["kind"],
                                                                        tok.get("path"))
    lines = [f"token directory {out}: tokenizer {name}, vocab {index['vocab_size']}, "
             f"eod {index['eod']}, {index['dtype']}"]
    what = "documents" if "pairs" not in index else "pairs"
    for split, s in index["splits"].items():
        lines.append(f"  {split:<10} {s['documents']:>10,} {what} {s['tokens']:>14,} tokens "
                     f"(longest {what[:-1]} {s['longest_document']:,})")
    if "pairs" in index:
        lines.append(f"  pairs: source {index['pairs']['source']!r}, target "
                     f"{index['pairs']['target']!r}")
    return lines


def cmd_prepare_data(a: argparse.Namespace) -> int:
    """Run `prepare-data`: tokenize the inputs into `--out`, print a summary."""
    if not a.input and not a.hf_dataset:
        raise ConfigError("prepare-data needs --input GLOB... or --hf-dataset PATH")
    total = 1 if a.hf_dataset else len(expand_inputs(a.input))
    with a.progress.task("files", total) as update:
        index = prepare_data(a.input or [], a.out, tokenizer=a.tokenizer,
                             val_fraction=a.val_fraction, text_field=a.text_field,
                             hf_dataset=a.hf_dataset, target_field=a.target_field,
                             progress=lambda done, _total: update(done))
    if getattr(a, "json", False):
        print(json.dumps(index))
    else:
        print("\n".join(summary_lines(index, a.out)))
    return 0
