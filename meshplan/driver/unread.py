"""Weights no op of the step reads (a pooler, the vision or audio tower of a
model trained on text): where they start, and how a checkpoint keeps them.

Invariants:
- They are the Job's parameters and buffers that no op reads
  (`unread_names`). No rank holds them, they get no gradient, and torch's
  optimizers skip them, so a run ends them as it started them.
- Where they start is resolved once, by the process that reports the run:
  a resumed checkpoint's copy; else `--init-from`'s tensors (a pretrained
  tower stays the pretrained one); else the built module's.
- They are written once as `OUT/unread_weights.pt` (a torch file, read
  memory-mapped), which rank 0 puts in every checkpoint beside `model.json`
  (`RunSpec.checkpoint_files`: linked where it can, its sha256 in
  `COMPLETE`). So a checkpoint exports, resumes and starts another run
  whole. A Job without such weights writes no file and removes a stale one.
- A checkpoint saved before this file existed has none: a run that starts
  from it warns and keeps the module's values; an export refuses in one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from meshplan.errors import RuntimeFault
from meshplan.ir import Role
from meshplan.ir.fileio import write_torch
from meshplan.ir.job import Job
from meshplan.runtime.checkpoint import file_sha256, read_marker
from meshplan.runtime.init_weights import open_torch, read_box

UNREAD_FILE = "unread_weights.pt"
log_line = logging.getLogger("meshplan")


def unread_names(job: Job) -> list[str]:
    """The Job's parameters and buffers (graph input names) no op reads."""
    g = job.graph
    read = g.consumers()
    return [g.values[i].name for i in g.inputs
            if g.values[i].role in (Role.PARAM, Role.BUFFER) and i not in read]


def start_values(job: Job, weights: dict[str, torch.Tensor], init_from: str = "",
                 resume_from: str = "") -> dict[str, torch.Tensor]:
    """Each unread weight as the run starts it (see the module docstring);
    `init_from` is the checked source JSON (`driver/init_from.weight_source`)."""
    names = unread_names(job)
    if not names:
        return {}
    found: dict[str, torch.Tensor] = {}
    src = json.loads(init_from) if init_from else None
    if resume_from:
        found = _saved(resume_from, names)
    elif src is not None and src["kind"] == "checkpoint":
        found = _saved(src["path"], names)
    elif src is not None:
        files: dict = {}
        found = {n: read_box(files, src["tensors"][n][0], src["tensors"][n][1], ())
                 for n in names if n in src["tensors"]}
    return {n: found[n].to(weights[n].dtype).clone() if n in found
            else weights[n].detach().clone() for n in names}


def write_unread(out: str, values: dict[str, torch.Tensor]) -> None:
    """`OUT/unread_weights.pt` holding `values`; none (a stale one removed) if empty."""
    path = Path(out) / UNREAD_FILE
    if not values:
        path.unlink(missing_ok=True)
        return
    write_torch(path, values)


def saved_unread(checkpoint: str | Path, marker: dict | None = None) -> dict[str, torch.Tensor]:
    """The unread weights a complete checkpoint holds (memory-mapped), checked
    against the sha256 in its `COMPLETE`; {} when it holds none."""
    root = Path(checkpoint)
    files = (marker or read_marker(root, "use another checkpoint")).get("files") or {}
    if UNREAD_FILE not in files:
        return {}
    if file_sha256(root / UNREAD_FILE) != files[UNREAD_FILE]:
        raise RuntimeFault(f"checkpoint {root}: {UNREAD_FILE} is missing or not the one saved "
                           "with it (edited or corrupted); use another checkpoint")
    return open_torch(str(root / UNREAD_FILE))


def _saved(checkpoint: str, names: list[str]) -> dict[str, torch.Tensor]:
    """`names` from a checkpoint's copy; a warning when it has none (saved
    before checkpoints held them)."""
    saved = saved_unread(checkpoint)
    missing = [n for n in names if n not in saved]
    if missing:
        log_line.warning("checkpoint %s holds no value of %d weight(s) no op reads (e.g. "
                         "'%s'; it was saved by an earlier meshplan): they keep the "
                         "module's starting values", checkpoint, len(missing), missing[0])
    return saved
