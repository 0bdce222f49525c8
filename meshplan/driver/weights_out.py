"""Weights files, written streamed: safetensors (ours, not the library's)
and torch state dicts, sharded like transformers shards them.

Invariants:
- A tensor to write is an `OutTensor`: its names in the file, the name its
  source fetches it by, its shape and dtype. Everything about the files
  (which shard holds what, each header, the index) is decided from these
  alone, before any tensor is read.
- safetensors: 8 bytes little-endian header length, a JSON header
  `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
  {"format": "pt"}}` padded with spaces to a multiple of 8, then each
  tensor's raw little-endian bytes in header order, with no gaps. A tensor
  is written under its first name only (a tied tensor once).
- torch: each shard is a state dict (`write_torch`) in which every name of
  a tensor is the same tensor object, so `load_state_dict` keeps them tied.
- Peak memory: safetensors holds one fetched tensor at a time (fetched,
  written, dropped); a torch shard holds its own tensors until it is saved.
- Sharding (`plan_shards`): tensors in the given order, a new shard when
  the next tensor would take the current one past the limit; a tensor
  larger than the limit gets a shard of its own. One shard is `model.EXT`,
  N are `model-0000i-of-0000N.EXT` with `model.EXT.index.json`
  (`{"metadata": {"total_size"}, "weight_map": {name: file}}`, every name).
- Every file goes through `meshplan.ir.fileio` (temp file, rename).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from meshplan.errors import ConfigError
from meshplan.ir.fileio import atomic_stream, write_atomic, write_torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

Fetch = Callable[[str], torch.Tensor]


@dataclass(frozen=True, slots=True)
class OutTensor:
    """One tensor to write: `names` in the file (the first is the one a
    safetensors file holds), `key` its source's name for it."""

    names: tuple[str, ...]
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def parse_size(text: str) -> int:
    """`--max-shard-size`: bytes, or a number with KB/MB/GB (powers of 10,
    as transformers reads them) or KiB/MiB/GiB; one line if it is not one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise ConfigError(f"--max-shard-size {text}: not a size; give bytes or a number with "
                          "KB, MB, GB (or KiB, MiB, GiB), e.g. --max-shard-size 5GB")
    return int(float(m.group(1)) * _UNITS[unit])


def plan_shards(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """`tensors` cut into shards of at most `max_bytes` each (in order)."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_files(ext: str, n: int) -> list[str]:
    """The file names of `n` shards of extension `ext` (`safetensors`, `pt`)."""
    if n == 1:
        return [f"model.{ext}"]
    return [f"model-{i:05d}-of-{n:05d}.{ext}" for i in range(1, n + 1)]


def write_shards(out: Path, tensors: list[OutTensor], fetch: Fetch, ext: str,
                 max_bytes: int) -> list[str]:
    """Write `tensors` (fetched one at a time) into `out` as shards of
    `ext` (`safetensors` or `pt`), with an index when there are several;
    returns the file names written."""
    shards = plan_shards(tensors, max_bytes)
    files = shard_files(ext, len(shards))
    write = write_safetensors if ext == "safetensors" else write_torch_shard
    for name, shard in zip(files, shards):
        write(out / name, shard, fetch)
    if len(files) == 1:
        return files
    index = f"model.{ext}.index.json"
    weight_map = {n: f for f, shard in zip(files, shards) for t in shard
                  for n in (t.names[:1] if ext == "safetensors" else t.names)}
    body = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(out / index, (json.dumps(body, indent=2) + "\n").encode())
    return files + [index]


def safetensors_header(tensors: list[OutTensor], metadata: dict | None = None) -> bytes:
    """The 8-byte length and the padded JSON header of a file of `tensors`
    (`metadata`: string values, beside `format`), the same bytes each time."""
    header: dict = {}
    at = 0
    for t in tensors:
        header[t.names[0]] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path: Path, tensors: list[OutTensor], fetch: Fetch,
                      metadata: dict | None = None) -> None:
    """One safetensors file of `tensors`, each fetched, written and dropped in turn."""
    with atomic_stream(path) as f:
        f.write(safetensors_header(tensors, metadata))
        for t in tensors:
            data = _checked(fetch(t.key), t)
            f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
            del data


def write_torch_shard(path: Path, tensors: list[OutTensor], fetch: Fetch) -> None:
    """One torch state dict of `tensors`, every name of a tensor the same object."""
    state = {}
    for t in tensors:
        data = _checked(fetch(t.key), t)
        state.update(dict.fromkeys(t.names, data))
    write_torch(path, state)


def _checked(data: torch.Tensor, t: OutTensor) -> torch.Tensor:
    assert tuple(data.shape) == t.shape and data.dtype == t.dtype, (t, data.shape, data.dtype)
    if data.requires_grad or data.device.type != "cpu" or not data.is_contiguous():
        data = data.detach().cpu().contiguous()
    return data  # the fetched object itself when it can be: nothing else refers to it
