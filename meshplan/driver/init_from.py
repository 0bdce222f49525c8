"""`--init-from PATH`: where a run's starting weights come from, resolved
and checked once, before any rank starts.

PATH is a transformers `save_pretrained` directory (safetensors or torch
`.bin` files, sharded or not), a torch state-dict file (or a `.safetensors`
file), or a meshplan checkpoint (its weights only; any layout).

Invariants:
- Every parameter of the Job is found, under one of its names (a tied
  weight's aliases), with or without the module's `prefix` (`model.`: the
  `HFLoss` wrapper before transformers' names), and has the Job's shape; a
  buffer is taken when the source has it. The first mismatch is one line
  naming the tensor, and nothing is written.
- Only headers are read here (safetensors headers, a memory-mapped torch
  file, a checkpoint's manifest); the ranks read their own slices
  (`runtime/init_weights.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

from meshplan.errors import ConfigError
from meshplan.ir import Role
from meshplan.models.hf import CONFIG_FILE
from meshplan.runtime.checkpoint import COMPLETE, saved_state
from meshplan.runtime.init_weights import open_torch

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE = ("model.safetensors", "pytorch_model.bin")


def is_pretrained_dir(path: str) -> bool:
    """True for a transformers `save_pretrained` directory."""
    return (Path(path) / CONFIG_FILE).is_file()


def weight_source(path: str, job, prefix: str = "") -> str:
    """The checked source of the Job's starting weights in `path`, as the
    JSON a rank reads (`RunSpec.init_from`)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--init-from {path} does not exist; give a save_pretrained "
                          "directory, a state-dict file or a meshplan checkpoint")
    if (p / COMPLETE).is_file():
        _check(path, job, prefix, _checkpoint_tensors(p))
        return json.dumps({"kind": "checkpoint", "path": str(p.resolve())})
    tensors = {}
    for file in _files(p):
        tensors.update({k: (str(file), shape) for k, shape in _headers(file).items()})
    found = _check(path, job, prefix, {k: shape for k, (_, shape) in tensors.items()})
    return json.dumps({"kind": "files",
                       "tensors": {name: [tensors[key][0], key] for name, key in found.items()}})


def _files(p: Path) -> list[Path]:
    """The weight files of a directory (its index's, or its single file), or `p`."""
    if p.is_file():
        return [p]
    for index in _INDEXES:
        if (p / index).is_file():
            try:
                weight_map = json.loads((p / index).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{p / index}: not a transformers weight index ({e}); "
                                  "save the model again") from None
            return [p / f for f in sorted(set(weight_map.values()))]
    for single in _SINGLE:
        if (p / single).is_file():
            return [p / single]
    raise ConfigError(f"--init-from {p} holds no weights ({', '.join(_SINGLE)} or an index) "
                      "and is not a meshplan checkpoint (no COMPLETE)")


def _headers(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of one weight file, reading no tensor data."""
    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open  # optional

            with safe_open(str(file), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

        sd = open_torch(str(file))
    except ImportError:
        raise ConfigError(f"{file} is a safetensors file: pip install safetensors") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        raise ConfigError(f"--init-from {file}: cannot read it ({type(e).__name__}: "
                          f"{str(e)[:120]}); give safetensors or a torch state dict") from None
    if not isinstance(sd, dict) or not all(hasattr(t, "shape") for t in sd.values()):
        raise ConfigError(f"--init-from {file} is not a state dict (name -> tensor); save "
                          "module.state_dict() with torch.save")
    return {k: tuple(t.shape) for k, t in sd.items()}


def _checkpoint_tensors(p: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(shape) for name, (shape, _) in saved_state(str(p)).items()}


def _check(path: str, job, prefix: str, have: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """State name -> the source's key for every parameter (and the buffers
    found); one line for the first parameter missing or of another shape."""
    g = job.graph
    found = {}
    for v in (g.values[i] for i in g.inputs):
        if v.role not in (Role.PARAM, Role.BUFFER):
            continue
        names = g.names_of(v.name)
        keys = [k for n in names for k in (n, n.removeprefix(prefix)) if k in have]
        if not keys:
            if v.role is Role.PARAM:
                raise ConfigError(f"--init-from {path} has no tensor "
                                  f"'{names[0].removeprefix(prefix)}' (of parameter "
                                  f"'{names[0]}'); its {len(have)} tensors are "
                                  f"another model's (e.g. '{next(iter(have), '')}'): give the "
                                  "model flags it was saved with")
            continue
        key = keys[0]
        if have[key] != tuple(v.meta.shape):
            raise ConfigError(f"--init-from {path}: '{key}' is {list(have[key])} but the model's "
                              f"'{v.name}' is {list(v.meta.shape)}: it was saved from another "
                              "size; give the sizes it was saved with")
        found[v.name] = key
    return found
