"""The token directory: what `meshplan prepare-data` writes and training reads.

A token directory holds
- `train.bin`, `validation.bin`: flat token ids, little-endian `uint16` when
  `vocab_size <= 65536`, else `uint32`; every document's tokens are followed
  by the end-of-document id `eod` (the nanoGPT / Megatron convention);
- `index.json`: `{"format": "meshplan.tokens", "version": 1, "dtype", "vocab_size",
  "eod", "tokenizer": {spec}, "splits": {split: {"documents", "tokens",
  "longest_document"}}, "sources", "val_fraction"}`;
- `tokenizer.json` when the tokenizer is a BPE trained by prepare;
- for paired data (`prepare-data --target-field`): `index.json` names the
  two fields (`"pairs": {"source", "target"}`), each pair is its source and
  its target, each followed by eod, and `train.idx`, `validation.idx` hold
  each pair's two ends (little-endian `uint64` [pairs, 2]: where its source
  ends and where its target ends, each after its eod); a split's
  `documents` counts pairs, its `longest_document` a pair's tokens.

Invariants:
- `TokenData` never reads a whole `.bin` into memory: `tokens` is a
  read-only `np.memmap` (an empty split is an empty array).
- `release()` keeps the process's resident memory flat however large the
  file: it unmaps the pages read so far (MADV_DONTNEED; the page cache keeps
  them, so a re-read is a minor fault). Without it the kernel maps whole
  large folios of cached file around each read ("fault-around"); measured
  (benchmarks/data.py, kernel 6.18): 3200 shuffled reads of 258 bytes left
  ~380 MiB of a warm 381 MiB file resident; with a release after each read
  the file-backed resident memory was the same 79 MiB (mostly libraries)
  for a 38 and a 381 MiB file. Cost, measured in a bare loop: +0.06 ms a read.
- A `.bin` whose size disagrees with `index.json` is refused on opening, so
  every later read is in bounds.
- `longest_document` counts a document's tokens with its eod.
- A paired split's `.idx` is memory-mapped, its size checked against the
  index as the `.bin`'s is, and its last end against the split's tokens.
- `TokenWriter` appends one document (or pair) at a time: no list of all tokens.
"""

from __future__ import annotations

import contextlib
import json
import mmap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from meshplan.errors import ConfigError
from meshplan.ir.fileio import atomic_stream, write_atomic

FORMAT = "meshplan.tokens"
VERSION = 1
INDEX = "index.json"
SPLITS = ("train", "validation")
FIX = "run `meshplan prepare-data --input FILES --out DIR` to make one"
_ENDS = np.dtype("<u8")  # a paired split's ends (`.idx`)


def dtype_for(vocab_size: int) -> np.dtype:
    """The on-disk token dtype: little-endian uint16 up to 65536 ids, else uint32."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def bin_path(data_dir: str | Path, split: str) -> Path:
    """`DIR/<split>.bin`."""
    return Path(data_dir) / f"{split}.bin"


def idx_path(data_dir: str | Path, split: str) -> Path:
    """`DIR/<split>.idx`: a paired split's ends."""
    return Path(data_dir) / f"{split}.idx"


def is_token_dir(path: str | Path) -> bool:
    """True when `path` is a directory with an index.json of our format."""
    index = Path(path) / INDEX
    if not index.is_file():
        return False
    try:
        return json.loads(index.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_index(data_dir: str | Path) -> dict:
    """The checked index of the token directory `data_dir` (ConfigError if it is not one)."""
    path = Path(data_dir)
    if not path.is_dir():
        raise ConfigError(f"data directory {path} does not exist or is not a directory; {FIX}")
    try:
        index = json.loads((path / INDEX).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is not a token directory (no {INDEX}); {FIX}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path / INDEX} cannot be read ({e}); {FIX} again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(f"{path / INDEX} is not a meshplan token index "
                          f"(format is not {FORMAT!r}); {FIX}")
    if index.get("version") != VERSION:
        raise ConfigError(f"{path} has token format version {index.get('version')!r}; this "
                          f"meshplan reads version {VERSION}: prepare it again with this "
                          "version's `meshplan prepare-data`")
    return index


@dataclass(frozen=True, slots=True)
class SplitStats:
    """The size of one split: documents, tokens (eods included), longest document."""

    documents: int = 0
    tokens: int = 0
    longest_document: int = 0

    def add(self, length: int) -> SplitStats:
        """The stats with one more document of `length` tokens (its eod included)."""
        return SplitStats(self.documents + 1, self.tokens + length,
                          max(self.longest_document, length))


class TokenData:
    """One split of a token directory, memory-mapped read-only.

    Attributes: `data_dir`, `split`, `index` (the dict of index.json),
    `vocab_size`, `eod`, `dtype`, `tokens` (the memmap), `longest_document`,
    `documents`, `pairs` (the two fields of paired data, else None) and
    `ends` (paired data: the memmap of the pairs' ends, [documents, 2]).
    """

    def __init__(self, data_dir: str | Path, split: str = "train"):
        self.data_dir = Path(data_dir)
        self.split = split
        self.index = read_index(self.data_dir)
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
        try:
            stats = SplitStats(**self.index["splits"][split])
            self.vocab_size = int(self.index["vocab_size"])
            self.eod = int(self.index["eod"])
            self.dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{self.data_dir / INDEX} is damaged ({e!r} is wrong or "
                              f"missing); {FIX} again") from None
        self.longest_document = stats.longest_document
        self.documents = stats.documents
        self.pairs: dict | None = self.index.get("pairs")
        self.tokens = self._map(bin_path(self.data_dir, split), self.dtype, (stats.tokens,),
                                "tokens")
        self.ends = np.zeros((0, 2), dtype=_ENDS)
        if self.pairs is not None:
            self.ends = self._map(idx_path(self.data_dir, split), _ENDS, (stats.documents, 2),
                                  "pairs")
            if len(self.ends) and int(self.ends[-1, 1]) != stats.tokens:
                raise ConfigError(f"{idx_path(self.data_dir, split)} does not end at the "
                                  f"split's {stats.tokens} tokens; the directory is damaged: "
                                  f"{FIX} again")

    def _map(self, path: Path, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
        size = path.stat().st_size if path.is_file() else None
        need = int(np.prod(shape)) * dtype.itemsize
        if size != need:
            found = "is missing" if size is None else f"has {size} bytes"
            raise ConfigError(f"{path} {found}, but {INDEX} says {shape[0]} {dtype.name} "
                              f"{what} ({need} bytes); the directory is incomplete or "
                              f"damaged: {FIX} again")
        if need == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r", shape=shape)

    def __len__(self) -> int:
        return len(self.tokens)

    def release(self) -> None:
        """Unmap the pages read so far (see the module docstring); reads stay valid."""
        for array in (self.tokens, self.ends):
            raw = getattr(array, "_mmap", None)
            if raw is not None and hasattr(mmap, "MADV_DONTNEED"):
                raw.madvise(mmap.MADV_DONTNEED)

    def check_seq_len(self, seq_len: int) -> None:
        """ConfigError unless the split holds a sample of `seq_len + 1` tokens
        and some document is at least that long (paired data: unless it
        holds a pair, and `seq_len` has room for a source and a target)."""
        where = f"the {self.split} split of {self.data_dir}"
        if seq_len < 1 + (self.pairs is not None):
            raise ConfigError(f"seq_len {seq_len} must be at least "
                              f"{1 + (self.pairs is not None)}")
        if self.pairs is not None:
            if not self.documents:
                raise ConfigError(f"{where} holds no pair; prepare more rows")
            return
        if len(self.tokens) < seq_len + 1:
            raise ConfigError(f"{where} has {len(self.tokens)} tokens, fewer than one sample "
                              f"of seq_len+1 = {seq_len + 1}; lower --seq-len or prepare "
                              "more text")
        if seq_len + 1 > self.longest_document:
            raise ConfigError(f"seq_len {seq_len} is longer than every document of "
                              f"{self.data_dir} (the longest has {self.longest_document} "
                              "tokens); lower --seq-len or prepare longer documents")


class TokenWriter:
    """Writes a token directory's `.bin` files (and, for `pairs`, the
    `.idx` files) one document or pair at a time, then its index
    (`finish`). Use as a context manager: the files close on exit."""

    def __init__(self, data_dir: str | Path, vocab_size: int, eod: int,
                 pairs: dict | None = None):
        self.data_dir = Path(data_dir)
        self.vocab_size, self.eod, self.pairs = vocab_size, eod, pairs
        self.dtype = dtype_for(vocab_size)
        self.stats = {s: SplitStats() for s in SPLITS}
        self._stack = contextlib.ExitStack()
        self._files: dict[str, BinaryIO] = {
            s: self._stack.enter_context(atomic_stream(bin_path(data_dir, s))) for s in SPLITS}
        self._ends: dict[str, BinaryIO] = {} if pairs is None else {
            s: self._stack.enter_context(atomic_stream(idx_path(data_dir, s))) for s in SPLITS}

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*(exc or (None, None, None)))  # an error: no .bin is kept

    def add(self, split: str, *parts) -> None:
        """Append one document to `split`: `parts` is its ids (without eod),
        or for paired data its source's and its target's."""
        assert len(parts) == (1 if self.pairs is None else 2), len(parts)
        lengths = [len(p) + 1 for p in parts]
        arr = np.empty(sum(lengths), dtype=self.dtype)
        at = 0
        for ids, n in zip(parts, lengths):
            arr[at:at + n - 1] = ids
            arr[at + n - 1] = self.eod
            at += n
        self._files[split].write(arr.tobytes())
        if self.pairs is not None:
            start = self.stats[split].tokens
            ends = np.array([start + lengths[0], start + at], dtype=_ENDS)
            self._ends[split].write(ends.tobytes())
        self.stats[split] = self.stats[split].add(len(arr))

    def finish(self, tokenizer: dict, sources: list[str], val_fraction: float) -> dict:
        """Close the `.bin` files, write index.json and return the index."""
        self._stack.close()
        index = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name,
                 "vocab_size": self.vocab_size, "eod": self.eod, "tokenizer": tokenizer,
                 "splits": {s: asdict(st) for s, st in self.stats.items()},
                 "sources": sources, "val_fraction": val_fraction}
        if self.pairs is not None:
            index["pairs"] = self.pairs
        write_atomic(self.data_dir / INDEX, (json.dumps(index, indent=2) + "\n").encode())
        return index
