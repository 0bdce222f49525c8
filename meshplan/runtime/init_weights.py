"""A rank's starting weights read from files (`--init-from`): each rank
reads only the slices its plan holds.

Invariants:
- The driver resolved and checked the source (`driver/init_from.py`): every
  parameter's file, key and shape; a rank only reads. A source is JSON:
  `{"kind": "files", "tensors": {state name: [file, key]}}` (safetensors
  files read by slice through `safe_open`, torch files memory-mapped), or
  `{"kind": "checkpoint", "path": DIR}` (a meshplan checkpoint's parameters
  and buffers, at any layout; its optimizer slots and step are not read).
- A tensor is copied into the state the rank already holds (`copy_`), so
  its dtype is the plan's (a bf16 file into fp32 parameters is cast).
- A state name the rank does not hold (another stage's) is not read.
"""

from __future__ import annotations

import json

import torch

from meshplan.ir import Role
from meshplan.runtime.checkpoint import load_weights as from_checkpoint


def load_weights(source: str, state: dict, ctx) -> None:
    """Fill this rank's parameters (and the buffers the source has) from `source`."""
    src = json.loads(source)
    if src["kind"] == "checkpoint":
        from_checkpoint(src["path"], state, ctx)
        return
    ids = {v.name: v.id for v in ctx.view.values.values() if v.role in (Role.PARAM, Role.BUFFER)}
    files: dict[str, object] = {}
    for name, (file, key) in src["tensors"].items():
        if state.get(name) is None:
            continue
        box = ctx.box(ids[name])
        with torch.no_grad():
            state[name].copy_(read_box(files, file, key, box))


def read_box(files: dict, file: str, key: str, box) -> torch.Tensor:
    """The `box` (`()`: all) of tensor `key` of `file`, reading no more of it
    than that; `files` keeps each file opened once."""
    index = tuple(slice(a, b) for a, b in box)
    if file.endswith(".safetensors"):
        if file not in files:
            from safetensors import safe_open  # optional

            files[file] = safe_open(file, framework="pt")
        f = files[file]
        return f.get_slice(key)[index] if index else f.get_tensor(key)
    if file not in files:
        files[file] = open_torch(file)
    return files[file][key][index]


def open_torch(file: str) -> dict:
    """A torch state-dict file, memory-mapped where its format allows it
    (the zip format torch has written since 1.6), so reading a slice reads
    only its pages."""
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # the legacy format cannot be mapped
        return torch.load(file, map_location="cpu", weights_only=True)
