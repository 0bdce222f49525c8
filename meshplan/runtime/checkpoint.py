"""Checkpoints through torch.distributed.checkpoint, one shard per rank,
loadable into any other parallel layout.

Invariants:
- Each state tensor is saved as the slices ranks hold, one key per slice:
  `<state name>|<box>` (box = the logical slice, e.g. `0:96,0:64`). Of
  replicas of a slice only the first (coordinate 0 on every non-Shard axis)
  writes it. Optimizer slots and module buffers are state like parameters;
  gradient accumulators are empty between steps and are not saved.
- Loading intersects the boxes this rank needs with the saved ones (the same
  arithmetic as stage transfers), so a checkpoint from tp=2 loads into tp=1,
  pp=2 into pp=1, and back.
- `COMPLETE` is written by rank 0 only after every rank's shard is written
  (a barrier): a checkpoint without it, e.g. one cut short by a killed rank,
  is never loaded. It is a sealed file (versioned, checksummed) holding the
  next step and a manifest of every state tensor's logical shape and dtype,
  so `check_resumable` refuses a checkpoint of another model before any
  rank starts. It also holds the sha256 of DCP's `.metadata` file, which
  DCP reads with pickle: `load` checks the hash first, so only the bytes
  this code wrote are ever unpickled.
- A tied tensor is one state entry, saved once under its graph input's
  name (each stage's copy is the same slice under the same key, which DCP
  writes once), and found on load under any of its names.
- Files the driver names (`RunSpec.checkpoint_files`: the resolved
  `config.toml`, the `model.json` an export reads) are copied in by rank 0
  before `COMPLETE`, which holds each one's sha256.
- The data position (the next step) is saved with it; data is a pure
  function of the step, so a resumed run sees exactly the batches an
  uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshplan.errors import ConfigError, PlanError, RuntimeFault
from meshplan.ir import Role
from meshplan.ir.fileio import read_sealed, seal, write_atomic
from meshplan.ir.sbp import Shard, intersect
from meshplan.ir.state_name import StateName, is_state

COMPLETE = "COMPLETE"
METADATA = ".metadata"  # DCP's index of the saved keys (a pickle)
STEP_KEY = "meshplan/next_step"
KIND, VERSION = "meshplan.checkpoint", 1


def box_key(box) -> str:
    return ",".join(f"{a}:{b}" for a, b in box) or "scalar"


def parse_box(text: str):
    if text == "scalar":
        return ()
    return tuple(tuple(int(x) for x in part.split(":")) for part in text.split(","))


def _primary(ctx, vid: int) -> bool:
    sbp = ctx.job.sbp[vid]
    return all(c == 0 for c, s in zip(ctx.coord, sbp) if not isinstance(s, Shard))


def _state_values(job) -> dict[str, int]:
    return {v.name: v.id for v in job.graph.values
            if v.role in (Role.PARAM, Role.BUFFER, Role.OPT_STATE)}


def state_slices(state: dict, job, ctx, primary_only: bool = False,
                 host: bool = True) -> dict[str, torch.Tensor]:
    """This rank's saved state (params, buffers, optimizer slots) as
    `<name>|<box>` -> its slice (on the host, or where it lives); with
    `primary_only`, only the first of replicas writes (a checkpoint), else
    every rank does (`verify` checks the replicas agree)."""
    values = _state_values(job)
    out = {}
    for name, t in state.items():
        if t is None or name not in values or (primary_only and not _primary(ctx, values[name])):
            continue
        t = t.detach().contiguous()
        out[f"{name}|{box_key(ctx.box(values[name]))}"] = t.cpu() if host else t
    return out


def save(path: str, state: dict, job, ctx, next_step: int, files=()) -> None:
    """Write this rank's shard; rank 0 copies `files` in and marks the
    checkpoint complete.

    An older `COMPLETE` in `path` is removed before any shard is overwritten,
    so a save cut short never leaves a marker over a mix of old and new
    shards."""
    # device tensors as they are: DCP's writer stages GPU tensors to host itself
    sd = state_slices(state, job, ctx, primary_only=True, host=False)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        sd[STEP_KEY] = torch.tensor(next_step)
        (Path(path) / COMPLETE).unlink(missing_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(sd, checkpoint_id=path)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        copied = {}
        for f in map(Path, files):
            data = f.read_bytes()
            write_atomic(Path(path) / f.name, data)
            copied[f.name] = hashlib.sha256(data).hexdigest()
        meta = _manifest(job, next_step) | {"metadata_sha256": _metadata_hash(path),
                                            "files": copied}
        write_atomic(Path(path) / COMPLETE, seal(KIND, VERSION, meta))


def _metadata_hash(path: str) -> str:
    return hashlib.sha256((Path(path) / METADATA).read_bytes()).hexdigest()


def _manifest(job, next_step: int) -> dict:
    g = job.graph
    return {"next_step": next_step, "world": job.mesh.world, "job": job.digest(),
            "state": {name: [list(g.values[vid].meta.shape), g.values[vid].meta.dtype.name]
                      for name, vid in sorted(_state_values(job).items())}}


def check_resumable(path: str, job) -> int:
    """The step a run of `job` resumes at from the checkpoint at `path`;
    raises (one line) when there is none, it is incomplete, or it holds
    another model's state. Cheap: reads only the `COMPLETE` manifest."""
    if not path:
        raise ConfigError("--resume needs --save-dir: the directory of the checkpoint to "
                          "continue from")
    root = Path(path)
    if not root.is_dir():
        raise RuntimeFault(f"checkpoint {path} does not exist; run with --save-dir {path} "
                           "first, or drop --resume")
    if not (root / COMPLETE).is_file():
        raise RuntimeFault(f"checkpoint {path} is incomplete (no {COMPLETE} marker: a run was "
                           "stopped while saving); resume from an earlier one or start afresh")
    try:
        meta = read_sealed(root / COMPLETE, KIND, VERSION)
    except PlanError as e:  # its wording ("recompile it") is for plans
        what = str(e).split("; ")[0].removeprefix(str(root / COMPLETE)).lstrip(": ")
        raise RuntimeFault(f"checkpoint {path} has a damaged {COMPLETE} marker ({what}); "
                           "resume from another checkpoint, or save it again") from None
    saved = meta.get("state")
    step = meta.get("next_step")
    if not isinstance(saved, dict) or not isinstance(step, int):
        raise RuntimeFault(f"{root / COMPLETE} lacks the state manifest; save the checkpoint "
                           "again with this meshplan")
    g = job.graph
    for name, vid in sorted(_state_values(job).items()):
        want = [list(g.values[vid].meta.shape), g.values[vid].meta.dtype.name]
        name = _saved_name(g, name, saved)
        if name not in saved:
            if is_state(name):
                continue  # an optimizer slot the saved optimizer lacks: it starts fresh
            raise RuntimeFault(f"checkpoint {path} has no '{name}': it was saved from another "
                               "model; resume with the model and size it was saved from")
        if saved[name] != want:
            raise RuntimeFault(f"checkpoint {path} holds '{name}' as {saved[name][1]} "
                               f"{saved[name][0]}, but this model needs {want[1]} {want[0]}: it "
                               "was saved from another model size; resume with the flags it "
                               "was saved with")
    want = meta.get("metadata_sha256")
    if not (root / METADATA).is_file() or _metadata_hash(path) != want:
        raise RuntimeFault(f"checkpoint {path}: {METADATA} is missing or not the one saved "
                           "with it (edited or corrupted); resume from another checkpoint")
    return step


def _saved_name(graph, name: str, saved) -> str:
    """The name state `name` was saved under: itself, or an alias of a tied
    tensor (`head.weight@exp_avg` for `wte.weight@exp_avg`)."""
    state = StateName.parse(name) if is_state(name) else None
    for n in graph.names_of(state.fqn if state else name):
        alias = str(StateName(n, state.slot)) if state else n
        if alias in saved:
            return alias
    return name


def read_slices(path: str) -> dict[str, torch.Tensor]:
    """Every state slice of a complete checkpoint (`<name>|<box>` -> tensor),
    read in this one process: what a run saved, for `verify`'s assembly."""
    root = Path(path)
    if not (root / COMPLETE).is_file():
        raise RuntimeFault(f"checkpoint {path} is incomplete (no {COMPLETE} marker)")
    meta = read_sealed(root / COMPLETE, KIND, VERSION)
    if _metadata_hash(path) != meta.get("metadata_sha256"):
        raise RuntimeFault(f"checkpoint {path}: {METADATA} is not the one saved with it")
    request = {}
    for key, md in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if "|" in key:
            request[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    dcp.load(request, checkpoint_id=path)
    return request


def load(path: str, state: dict, job, ctx) -> int:
    """Fill this rank's state from the checkpoint; returns the step to resume at."""
    check_resumable(path, job)
    saved: dict[str, list] = {}
    for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
        name, _, box = key.partition("|")
        if box:
            saved.setdefault(name, []).append(parse_box(box))
    values = _state_values(job)
    request, places = {STEP_KEY: torch.tensor(0)}, []
    for name, vid in values.items():
        if name not in state:
            continue
        want = ctx.box(vid)
        key_name = _saved_name(job.graph, name, saved)
        if key_name not in saved:
            continue  # an optimizer slot not yet created (SGD momentum): start fresh
        for box in saved[key_name]:
            part = intersect(want, box) if box else ()
            if part is None:
                continue
            key = f"{key_name}|{box_key(box)}"
            if key not in request:
                shape = tuple(b - a for a, b in box)
                request[key] = torch.empty(shape, dtype=job.graph.values[vid].meta.dtype.torch)
            places.append((name, vid, key, box, part))
    dcp.load(request, checkpoint_id=path)
    for name, vid, key, box, part in places:
        target = state[name]
        if target is None or tuple(target.shape) != tuple(b - a for a, b in ctx.box(vid)):
            shape = tuple(b - a for a, b in ctx.box(vid))
            target = state[name] = torch.empty(shape, dtype=request[key].dtype)
        mine = ctx.box(vid)
        dst = tuple(slice(a - m0, b - m0) for (a, b), (m0, _) in zip(part, mine))
        src = tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(part, box))
        target[dst] = request[key][src].to(target.device)
    return int(request[STEP_KEY])


def load_weights(path: str, state: dict, job, ctx) -> None:
    """Fill this rank's parameters and buffers (not its optimizer slots, not
    the step) from the checkpoint at `path`, of any layout: `--init-from`."""
    kept = {v.name for v in job.graph.values if v.role in (Role.PARAM, Role.BUFFER)}
    weights = {name: t for name, t in state.items() if t is not None and name in kept}
    load(path, weights, job, ctx)  # fills the tensors in place: `state` holds the same ones


def saved_state(path: str) -> dict[str, list]:
    """State name -> [shape, dtype] of what the complete checkpoint at `path`
    holds (its manifest; one line if it is incomplete or damaged)."""
    if not (Path(path) / COMPLETE).is_file():
        raise RuntimeFault(f"checkpoint {path} is incomplete (no {COMPLETE} marker)")
    try:
        return read_sealed(Path(path) / COMPLETE, KIND, VERSION)["state"]
    except (PlanError, KeyError):
        raise RuntimeFault(f"checkpoint {path} has a damaged {COMPLETE} marker; use another "
                           "checkpoint") from None
def saved_boxes(path: str) -> dict[str, list[tuple]]:
    """Each saved tensor's slices, name -> boxes, from DCP's index (a pickle:
    call this only once `COMPLETE`'s `metadata_sha256` is checked)."""
    boxes: dict[str, list[tuple]] = {}
    for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
        name, _, box = key.partition("|")
        if box:
            boxes.setdefault(name, []).append(parse_box(box))
    return boxes


def read_tensor(path: str, name: str, boxes: list[tuple], shape: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor:
    """One whole saved tensor, its slices read straight into their places in
    one new tensor: nothing else of the checkpoint is read or held. A tensor
    its slices do not cover (they never overlap: one writer per slice) is a
    damaged checkpoint, one line."""
    full = torch.empty(shape, dtype=dtype)
    covered = sum(_volume(box) for box in boxes)
    if covered != full.numel():
        raise RuntimeFault(f"checkpoint {path}: the saved slices of '{name}' cover {covered} "
                           f"of its {full.numel()} elements (damaged); export another "
                           "checkpoint")
    request = {f"{name}|{box_key(box)}": full[tuple(slice(a, b) for a, b in box)]
               for box in boxes}
    with warnings.catch_warnings():  # "assuming ... a single process": it is, by design
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(request, checkpoint_id=path, no_dist=True)
    return full


def _volume(box: tuple) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n
