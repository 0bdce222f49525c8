"""Digests of every saved slice, so a corrupted shard is caught where it is
read, by the rank that reads it: DCP itself checks nothing of the bytes.

Invariants:
- Before its shard is written, each rank writes `__<rank>.digests.json`:
  the sha256 of every tensor it saves (`<name>|<box>` and the step-level
  keys), hashed from the very tensors DCP then writes. Rank 0 removes the
  old ones first (with the old `COMPLETE`), so none of another save is left.
- `COMPLETE` holds the sha256 of each digests file (`digest_files`), so a
  table is trusted only as far as the sealed marker vouches for it.
- Every read of a checkpoint (`load`, `load_weights`, `read_slices`,
  `read_tensor`) goes through `load_verified`: DCP reads, then each tensor
  read is hashed and compared; the first that differs is one line naming
  it and the rank whose shard holds it. No central pass over all bytes: a
  rank hashes only what it reads.
- A checkpoint whose marker has no `digests` (saved before them) is read
  unchecked.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshplan.errors import RuntimeFault
from meshplan.ir.fileio import write_atomic

PATTERN = "__*.digests.json"


def file_of(rank: int) -> str:
    return f"__{rank}.digests.json"


def digest(t: torch.Tensor) -> str:
    """The sha256 of a tensor's bytes (its dtype's, row-major)."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def remove_old(path: str) -> None:
    """Rank 0, before a save: the digests of an earlier save into `path` go."""
    for f in Path(path).glob(PATTERN):
        f.unlink(missing_ok=True)


def write_digests(path: str, rank: int, staged: dict) -> None:
    """This rank's table: every tensor it is about to write."""
    Path(path).mkdir(parents=True, exist_ok=True)
    table = {k: digest(t) for k, t in staged.items()}
    write_atomic(Path(path) / file_of(rank), json.dumps(table, sort_keys=True).encode())


def digest_files(path: str) -> dict[str, str]:
    """Rank 0, once every shard is written: each table's sha256, for `COMPLETE`."""
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(Path(path).glob(PATTERN))}


@lru_cache(maxsize=8)
def _table(path: str, vouched: tuple[tuple[str, str], ...]) -> dict[str, tuple[str, str]]:
    """key -> (sha256, the digests file naming it), each file checked
    against the marker's `vouched` hashes."""
    table: dict[str, tuple[str, str]] = {}
    for name, want in vouched:
        f = Path(path) / name
        data = f.read_bytes() if f.is_file() else b""
        if hashlib.sha256(data).hexdigest() != want:
            raise RuntimeFault(f"checkpoint {path}: {name} is missing or not the one saved "
                               "with it (edited or corrupted); use another checkpoint")
        table.update({k: (v, name) for k, v in json.loads(data).items()})
    return table


def load_verified(path: str, meta: dict, request: dict, **kwargs) -> None:
    """`dcp.load(request)`, then every tensor read checked against its digest
    (`meta`: the checkpoint's `COMPLETE` manifest)."""
    try:
        dcp.load(request, checkpoint_id=path, **kwargs)
    except (CheckpointException, RuntimeError, OSError, ValueError, EOFError) as e:
        if isinstance(e, CheckpointException):  # a BaseException wrapping each rank's
            e = next(iter(e.failures.values()))[0]
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise RuntimeFault(f"checkpoint {path}: a shard cannot be read ({first}): it is "
                           "corrupted or cut short; use another checkpoint") from None
    vouched = meta.get("digests")
    if vouched is None:
        return
    table = _table(str(path), tuple(sorted(vouched.items())))
    for key, t in request.items():
        want, where = table.get(key, (None, ""))
        if want is None:
            raise RuntimeFault(f"checkpoint {path}: no digest of '{key}' (damaged); use "
                               "another checkpoint")
        if digest(t) != want:
            rank = where.removeprefix("__").split(".")[0]
            raise RuntimeFault(f"checkpoint {path}: '{key}' (in rank {rank}'s shard) is not "
                               "what was saved: the shard is corrupted; resume from (or use) "
                               "another checkpoint")
