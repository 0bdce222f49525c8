"""Prepare a token directory (`tokens.py`) from text files or a local
Hugging Face dataset: what `meshplan prepare-data` runs.

Invariants:
- Inputs are read in a fixed order: the globs in the order given, each
  expanded sorted (recursive `**` allowed), a file once; a `.jsonl` file
  gives one document per non-blank line (its `text_field`), any other file
  is one document (UTF-8, undecodable bytes replaced). Empty texts are skipped.
- Paired data (`target_field`): a `.jsonl` line or a dataset row is one
  pair, its `text_field` the source and its `target_field` the target; a
  pair with an empty target is skipped (an empty source is kept). A BPE
  trains on both.
- Document k (in that order) goes to validation when a salted hash of k
  falls below `val_fraction`: the split depends on nothing else. With
  val_fraction > 0 and >= 2 documents each split gets at least one: the last
  document goes to whichever split is still empty (one document's tokens
  are held back for that; with one document it is train).
- Streaming: each document's tokens are written to its open split file as
  it is encoded; a BPE is trained on a first pass over the same inputs, so
  texts are read twice, never all held.
- No partial output: everything is written to a temporary sibling of
  `out`, renamed into place only when complete (an old token directory there
  is replaced only then); on any error the temporary directory and any
  parents made for it are removed, and `out` is as it was.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from meshplan.data.tokenizer import BPE_FILE, BPETokenizer, make_tokenizer, parse_tokenizer_arg
from meshplan.data.tokens import SPLITS, TokenWriter, is_token_dir
from meshplan.errors import ConfigError
from meshplan.ir.fileio import staged_directory

SALT = b"meshplan.prepare.validation:"
HF_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
               ".txt": "text", ".arrow": "arrow"}
Progress = Callable[[int, int], None]


def expand_inputs(globs: list[str]) -> list[str]:
    """The files `globs` name, each glob sorted, in order, each file once."""
    files: dict[str, None] = {}
    for pattern in globs:
        matched = [f for f in sorted(glob.glob(pattern, recursive=True)) if os.path.isfile(f)]
        if not matched:
            raise ConfigError(f"--input {pattern} matches no file; check the path or quote "
                              "the glob so that the shell leaves it to meshplan")
        files.update(dict.fromkeys(matched))
    return list(files)


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}); check that it exists "
                          "and is readable, or leave it out of --input") from None


def _jsonl_rows(path: str, fields: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ConfigError(f"{path}:{lineno}: not JSON ({e}); every line of a "
                                      ".jsonl file must be one JSON object") from None
                texts = tuple(row.get(f) if isinstance(row, dict) else None for f in fields)
                for field, text in zip(fields, texts):
                    if not isinstance(text, str):
                        raise ConfigError(f"{path}:{lineno}: no string field {field!r}; give "
                                          "the field that holds the text with "
                                          f"{_flag(field, fields)}")
                if texts[-1]:
                    yield texts  # type: ignore[misc]
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}); check that it exists "
                          "and is readable, or leave it out of --input") from None


def _flag(field: str, fields: tuple[str, ...]) -> str:
    """The flag that names `field`: the source's or text's, or the target's."""
    return "--text-field" if field == fields[0] else "--target-field"


def file_texts(path: str, fields: tuple[str, ...] = ("text",)) -> Iterator[tuple[str, ...]]:
    """The documents of one input file (see the module docstring): each a
    tuple of its `fields`' texts (a `.jsonl` file's; another file is one
    text, and cannot hold pairs)."""
    if path.endswith(".jsonl"):
        yield from _jsonl_rows(path, fields)
        return
    if len(fields) > 1:
        raise ConfigError(f"--target-field reads pairs from .jsonl files or --hf-dataset "
                          f"columns; {path} is neither: give .jsonl inputs")
    text = _read_text(path)
    if text:
        yield (text,)


def _load_hf(path: str):
    try:
        import datasets  # optional
    except ImportError:
        raise ConfigError("--hf-dataset needs the datasets library: pip install datasets") from None
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--hf-dataset {path} does not exist; give a local dataset "
                          "directory (save_to_disk) or local data files")
    try:
        if p.is_dir() and any((p / n).exists() for n in
                              ("dataset_info.json", "state.json", "dataset_dict.json")):
            return datasets.load_from_disk(str(p))
        if p.is_dir():
            return datasets.load_dataset(str(p))
        builder = HF_BUILDERS.get(p.suffix, "text")
        return datasets.load_dataset(builder, data_files=str(p))
    except Exception as e:  # datasets raises many kinds; each means "cannot load this"
        raise ConfigError(f"--hf-dataset {path} cannot be loaded "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          "; give a local dataset directory (save_to_disk) or data files") from None


def hf_texts(path: str, fields: tuple[str, ...] = ("text",)) -> Iterator[tuple[str, ...]]:
    """The documents of a local HF dataset (all its splits, sorted): each a
    tuple of its `fields` columns' texts."""
    ds = _load_hf(path)
    parts = [ds[k] for k in sorted(ds)] if isinstance(ds, dict) else [ds]
    for part in parts:
        for field in fields:
            if field not in part.column_names:
                raise ConfigError(f"--hf-dataset {path} has no column {field!r} (it has "
                                  f"{', '.join(part.column_names)}); choose one with "
                                  f"{_flag(field, fields)}")
        for batch in part.select_columns(list(fields)).iter(batch_size=1024):
            for texts in zip(*(batch[f] for f in fields)):
                if all(isinstance(t, str) for t in texts) and texts[-1]:
                    yield texts


def _documents(files: list[str], hf_dataset: str | None, fields: tuple[str, ...],
               progress: Progress | None) -> Iterator[tuple[str, ...]]:
    """Every document (a tuple of its fields' texts), in reading order;
    `progress(done, total)` after each file."""
    if hf_dataset is not None:
        yield from hf_texts(hf_dataset, fields)
        if progress:
            progress(1, 1)
        return
    for done, path in enumerate(files, 1):
        yield from file_texts(path, fields)
        if progress:
            progress(done, len(files))


def goes_to_validation(k: int, val_fraction: float) -> bool:
    """Whether document k goes to validation: a salted hash of k below val_fraction."""
    digest = hashlib.blake2b(SALT + str(k).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < val_fraction


def _last_split(k: int, writer: TokenWriter, val_fraction: float) -> str:
    train, val = (writer.stats[s].documents for s in SPLITS)
    if val_fraction == 0 or k == 0 or train == 0:
        return "train"
    if val == 0:
        return "validation"
    return "validation" if goes_to_validation(k, val_fraction) else "train"


def _write_documents(writer: TokenWriter, encode: Callable[[str], list[int]],
                     texts: Iterator[tuple[str, ...]], val_fraction: float, where: str) -> None:
    held: tuple[int, list[list[int]]] | None = None  # the latest, placed when the next comes
    for k, parts in enumerate(texts):
        ids = [encode(text) for text in parts]
        if held is not None:
            split = "validation" if goes_to_validation(held[0], val_fraction) else "train"
            writer.add(split, *held[1])
        held = (k, ids)
    if held is None:
        raise ConfigError(f"{where} hold no text (every file or row is empty); "
                          "give inputs with text")
    writer.add(_last_split(held[0], writer, val_fraction), *held[1])


def _check_out(out: str) -> Path:
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out} is a file; give a new or empty directory")
    if path.is_dir() and any(path.iterdir()) and not is_token_dir(path):
        raise ConfigError(f"--out {out} is a non-empty directory that is not a token "
                          "directory; give a new or empty directory (or an old token directory "
                          "to replace)")
    return path


def _check_args(inputs: list[str], hf_dataset: str | None, val_fraction: float) -> None:
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction} must be in [0, 1), e.g. 0.05")
    if not inputs and hf_dataset is None:
        raise ConfigError("no input: give --input FILES... or --hf-dataset PATH")
    if inputs and hf_dataset is not None:
        raise ConfigError("give either --input or --hf-dataset, not both")


def prepare_data(inputs: list[str], out: str, tokenizer: str = "bytes",
                 val_fraction: float = 0.05, text_field: str = "text",
                 hf_dataset: str | None = None, progress: Progress | None = None,
                 target_field: str | None = None) -> dict:
    """Tokenize `inputs` (globs) or `hf_dataset` into the token directory `out`;
    return its index. `progress(done_files, total_files)` as files are done.
    With `target_field`, each row is a pair: `text_field` its source (a
    prompt, a text to translate), `target_field` what is learned from it."""
    _check_args(inputs, hf_dataset, val_fraction)
    arg = parse_tokenizer_arg(tokenizer)
    files = expand_inputs(inputs) if hf_dataset is None else []
    out_path = _check_out(out)
    sources = files if hf_dataset is None else [hf_dataset]
    where = "the inputs " + (", ".join(inputs[:3]) if hf_dataset is None else hf_dataset)
    fields = (text_field,) if target_field is None else (text_field, target_field)
    pairs = None if target_field is None else {"source": text_field, "target": target_field}
    with staged_directory(out_path) as tmp:
        every = (t for doc in _documents(files, hf_dataset, fields, None) for t in doc)
        tok = make_tokenizer(arg, every)
        if isinstance(tok, BPETokenizer):
            tok.save(tmp / BPE_FILE)
        with TokenWriter(tmp, tok.vocab_size, tok.eod, pairs) as writer:
            texts = _documents(files, hf_dataset, fields, progress)
            _write_documents(writer, tok.encode, texts, val_fraction, where)
            index = writer.finish(tok.spec(), sources, val_fraction)
    return index
