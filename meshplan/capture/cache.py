"""A disk cache of captured graphs, keyed by what the capture depends on.

Invariants:
- An entry is `<cache_dir>/capture/<key>.json`, a sealed graph file
  (`ir.serialize`), written atomically: a reader sees a whole entry or none.
- The key is the sha256 of the caller's parts plus the meshplan version, a
  hash of meshplan's own source files and the torch version, so a release,
  a local edit of meshplan (editable installs keep `__version__`) or a torch
  upgrade each start afresh. Code outside meshplan that shapes the graph (a
  user's own model class) must go into the parts.
- A corrupt, unreadable or unwritable entry costs a rebuild and a warning on
  the "meshplan" logger, never an error.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

import meshplan
from meshplan.errors import MeshplanError
from meshplan.ir import Graph, check_well_formed
from meshplan.ir.serialize import load_graph, save_graph

log = logging.getLogger("meshplan")
_KEY = re.compile(r"[0-9a-f]{64}")


def capture_key(**parts) -> str:
    """The sha256 hex of `parts` (JSON-like values, dataclasses, tuples,
    enums, torch dtypes) plus the versions of meshplan and torch."""
    keyed = {
        "parts": _plain(parts),
        "meshplan": meshplan.__version__,
        "meshplan_source": _source_hash(),
        "torch": torch.__version__,
    }
    text = json.dumps(keyed, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _plain(x):
    """`x` as JSON types; raises TypeError for a value with no stable form."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"$dataclass": type(x).__qualname__, **_plain(dataclasses.asdict(x))}
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise TypeError(f"capture_key: dict keys must be strings, got {list(x)[:5]}")
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):  # torch.Size is a tuple
        return [_plain(v) for v in x]
    if isinstance(x, enum.Enum):
        return _plain(x.value)
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return {"$float": repr(x)}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"capture_key: cannot key a {type(x).__name__} ({x!r:.60}); pass plain "
                    "values, tuples, dicts or dataclasses")


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """sha256 over meshplan's .py files (relative path and contents).

    measured: 7 ms for 44 files, 130 KB, on a warm disk."""
    root = Path(meshplan.__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def cache_dir() -> Path:
    """`$MESHPLAN_CACHE_DIR` if set, else `~/.cache/meshplan`."""
    env = os.environ.get("MESHPLAN_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshplan"


def entry_path(key: str) -> Path:
    """Where the capture with `key` is cached."""
    if not _KEY.fullmatch(key):
        raise ValueError(f"capture cache key {key!r:.80} is not a capture_key() digest")
    return cache_dir() / "capture" / f"{key}.json"


def cached(key: str, make: Callable[[], Graph], enabled: bool = True) -> tuple[Graph, bool]:
    """The graph cached under `key`, or `make()` stored there; (graph, hit).

    With `enabled=False` the cache is neither read nor written."""
    if not enabled:
        return make(), False
    path = entry_path(key)
    if path.exists():
        try:
            graph = load_graph(path)
            check_well_formed(graph)
            return graph, True
        except (MeshplanError, AssertionError) as e:  # verify asserts
            log.warning("capture cache: ignoring bad entry (%s); capturing again", e)
    graph = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_graph(graph, path)
    except (OSError, MeshplanError) as e:
        log.warning("capture cache: cannot store %s (%s); continuing without the cache", path, e)
    return graph, False
