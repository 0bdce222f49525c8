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
  (a barrier, or for an async save rank 0's save finishing: [Note: rank 0's
  future]), and an older one is removed before any rank writes a shard: a
  checkpoint without it, e.g. one cut short by a killed rank, is never
  loaded. It is a sealed file (versioned, checksummed) holding the next
  step, the Job's digest and world, and a manifest of every state tensor's
  logical shape and dtype, so `check_resumable` refuses a checkpoint of
  another model before any rank starts. It also holds the sha256 of DCP's
  `.metadata` file, which DCP reads with pickle: `load` checks the hash
  first, so only the bytes this code wrote are ever unpickled.
- Sync and async saves share one path: `stage` (what a rank writes),
  `unmark` (the old marker gone), `mark` (files copied, `COMPLETE`). An
  async save (`runtime/async_save.AsyncSaver`) stages fresh host copies (the next step updates
  the state in place; on CPU `.cpu()` is no copy), writes on a gloo group of
  its own in a thread, at most one in flight per rank; its error is raised
  by that rank at the next `poll`/`wait`.
- Besides the state, a checkpoint holds everything a resume needs: the
  next step (rank 0), the fp16 growth counter (rank 0; the same on every
  rank), the random ops' seed (rank 0; restored at any layout) and each
  rank's torch RNG states (torch's CPU generator, the rank's CUDA one on a
  GPU; one key per rank), which only random aten ops capture does not
  rewrite draw from. They are restored only by the same Job on the same
  world: at another layout a rank's stream has no counterpart.
- The one fault-injection point, for tests: `MESHPLAN_FAULT_KILL_AFTER_SHARD`
  = `"<next step>:<rank>"` makes that rank `os._exit(137)` right after its
  shard of that checkpoint is written (`shard_writer`).
- Every saved tensor's sha256 is written beside the shards, and checked by
  whoever reads it (`runtime/shard_digests.py`): a corrupted shard is one
  line, not silently wrong weights.
- A tied tensor is one state entry, saved once under its graph input's
  name (each stage's copy is the same slice under the same key, which DCP
  writes once), and found on load under any of its names.
- Files the driver names (`RunSpec.checkpoint_files`: the resolved
  `config.toml`, the `model.json` an export reads, the weights no op reads,
  `driver/unread.py`) are linked or copied in by rank 0 before `COMPLETE`,
  which holds each one's sha256.
- The data position (the next step) is saved with it; data is a pure
  function of the step, so a resumed run sees exactly the batches an
  uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshplan.errors import ConfigError, PlanError, RuntimeFault
from meshplan.ir import Role
from meshplan.ir.fileio import atomic_stream, read_sealed, seal, write_atomic
from meshplan.ir.job import Job, JobReader
from meshplan.ir.sbp import Shard, intersect
from meshplan.ir.state_name import StateName, is_state
from meshplan.runtime import shard_digests

COMPLETE = "COMPLETE"
METADATA = ".metadata"  # DCP's index of the saved keys (a pickle)
STEP_KEY = "meshplan/next_step"
GOOD_STEPS_KEY = "meshplan/good_steps"  # fp16: steps since the loss scale last changed
SEED_KEY = "meshplan/seed"  # the random ops' seed (ops/counter_rng.py)
RNG_KEY = "meshplan/rng/{rank}"  # torch's CPU generator state, one per rank
CUDA_RNG_KEY = "meshplan/cuda_rng/{rank}"  # the rank's CUDA generator state
FAULT_KILL = "MESHPLAN_FAULT_KILL_AFTER_SHARD"  # "<next step>:<rank>": tests only
KIND, VERSION = "meshplan.checkpoint", 1


def box_key(box) -> str:
    return ",".join(f"{a}:{b}" for a, b in box) or "scalar"


def parse_box(text: str):
    if text == "scalar":
        return ()
    return tuple(tuple(int(x) for x in part.split(":")) for part in text.split(","))


def _primary(ctx, vid: int) -> bool:
    sbp = ctx.view.sbp[vid]
    return all(c == 0 for c, s in zip(ctx.coord, sbp) if not isinstance(s, Shard))


class SavedJob:
    """What a checkpoint's `COMPLETE` says of the Job that saved it: its
    digest, its world and every state's shape and dtype. The states are read
    only when asked (`JobReader.states` decodes every stage's values: the
    one rank that writes `COMPLETE` asks, when it writes it)."""

    def __init__(self, job: Job | JobReader):
        self._job = job
        self.digest = job.digest() if isinstance(job, Job) else job.digest
        self.world = job.mesh.world

    @cached_property
    def states(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self._job.states()


def _state_values(view) -> dict[str, int]:
    """This stage's state values (`ctx.view`), by name."""
    return {v.name: v.id for v in view.values.values()
            if v.role in (Role.PARAM, Role.BUFFER, Role.OPT_STATE)}


def state_slices(state: dict, ctx, primary_only: bool = False,
                 host: bool = True) -> dict[str, torch.Tensor]:
    """This rank's saved state (params, buffers, optimizer slots) as
    `<name>|<box>` -> its slice (on the host, or where it lives); with
    `primary_only`, only the first of replicas writes (a checkpoint), else
    every rank does (`verify` checks the replicas agree)."""
    values = _state_values(ctx.view)
    # a buffer the forward writes and never reads (spectral norm's `_u`, a statistic
    # kept for logging) is no value of the stage, only a final one: saved at its box
    values |= {n: v for n, v in ctx.view.finals.items() if "@" not in n and n not in values}
    out = {}
    for name, t in state.items():
        if t is None or name not in values or (primary_only and not _primary(ctx, values[name])):
            continue
        t = t.detach().contiguous()
        out[f"{name}|{box_key(ctx.box(values[name]))}"] = t.cpu() if host else t
    return out


def stage(state: dict, ctx, next_step: int, *, good_steps: int = 0, device=None,
          copy: bool = False) -> dict[str, torch.Tensor]:
    """What this rank writes into a checkpoint: its primary slices, its RNG
    states (`RNG_KEY`, and `CUDA_RNG_KEY` on a GPU) and, on rank 0, the next
    step, the fp16 growth counter and the random ops' seed. With `copy` every tensor is a fresh
    host copy (an async save: the next step updates the state in place, and
    on CPU `.cpu()` is the tensor itself); else device tensors as they are
    (DCP's writer stages GPU tensors to host itself)."""
    sd = state_slices(state, ctx, primary_only=True, host=False)
    if copy:
        sd = {k: torch.empty(t.shape, dtype=t.dtype).copy_(t) for k, t in sd.items()}
    rank = _rank()
    if rank == 0:
        sd[STEP_KEY] = torch.tensor(next_step)
        sd[GOOD_STEPS_KEY] = torch.tensor(good_steps)
        sd[SEED_KEY] = torch.tensor(ctx.random.seed)
    sd[RNG_KEY.format(rank=rank)] = torch.get_rng_state()
    if device is not None and torch.device(device).type == "cuda":
        sd[CUDA_RNG_KEY.format(rank=rank)] = torch.cuda.get_rng_state(device)
    return sd


def save(path: str, staged: dict, job: SavedJob, next_step: int, files=(), group=None) -> None:
    """Write this rank's shard (`stage`'s dict) and wait for every rank's;
    rank 0 then copies `files` in and marks the checkpoint complete."""
    unmark(path, group, staged)
    dcp.save(staged, storage_writer=shard_writer(path, next_step), process_group=group)
    if dist.is_initialized():
        dist.barrier(group)
    mark(path, job, next_step, files)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def unmark(path: str, group, staged: dict) -> None:
    """Rank 0 removes an older `COMPLETE` (and its digests) before any rank
    overwrites a shard (a barrier), so a save cut short never leaves a marker
    over a mix of old and new shards; then each rank writes the digests of
    what it is about to save (`runtime/shard_digests.py`)."""
    if _rank() == 0:
        (Path(path) / COMPLETE).unlink(missing_ok=True)
        shard_digests.remove_old(path)
    if dist.is_initialized():
        dist.barrier(group)
    shard_digests.write_digests(path, _rank(), staged)


def mark(path: str, job: SavedJob, next_step: int, files) -> None:
    """Rank 0, once every shard is written: copy `files` in, then write the
    sealed `COMPLETE` (manifest, `.metadata`'s hash, the files' hashes)."""
    if _rank() != 0:
        return
    copied = {f.name: _copy_in(f, Path(path) / f.name) for f in map(Path, files)}
    meta = _manifest(job, next_step) | {"metadata_sha256": _metadata_hash(path),
                                        "files": copied,
                                        "digests": shard_digests.digest_files(path)}
    write_atomic(Path(path) / COMPLETE, seal(KIND, VERSION, meta))


_LINK_BYTES = 64 << 20  # a file this large is linked, not copied, into a checkpoint


def _copy_in(src: Path, dst: Path) -> str:
    """`src` as `dst`, whole before it appears; its sha256. A large file (the
    weights no op reads: a tower can be GBs, and nothing rewrites it in
    place) is hard-linked where the file system allows it; a small one (a
    config a user may edit in place) is copied, so the copy stays the one hashed."""
    if src.stat().st_size >= _LINK_BYTES:
        tmp = dst.with_name(f".{dst.name}.link")
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
            os.replace(tmp, dst)
            return file_sha256(dst)
        except OSError:
            tmp.unlink(missing_ok=True)
    h = hashlib.sha256()
    with open(src, "rb") as f, atomic_stream(dst) as out:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            out.write(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of the file at `path`, read in chunks ("" if unreadable)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    except OSError:
        return ""
    return h.hexdigest()


def shard_writer(path: str, next_step: int):
    """DCP's file writer; under `FAULT_KILL` naming this step and rank, one
    that ends the process right after this rank's shard is written."""
    kill = os.environ.get(FAULT_KILL) == f"{next_step}:{_rank()}"
    return (_KillAfterShard if kill else dcp.FileSystemWriter)(path)


class _KillAfterShard(dcp.FileSystemWriter):
    """Fault injection for tests (`FAULT_KILL`): the shard, then `os._exit(137)`."""

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)
        done.wait()
        os._exit(137)


def _metadata_hash(path: str) -> str:
    return hashlib.sha256((Path(path) / METADATA).read_bytes()).hexdigest()


def _manifest(job: SavedJob, next_step: int) -> dict:
    return {"next_step": next_step, "world": job.world, "job": job.digest,
            "state": {name: [list(shape), dtype]
                      for name, (shape, dtype) in sorted(job.states.items())}}


def check_resumable(path: str, job: Job) -> int:
    """The step a run of `job` resumes at from the checkpoint at `path`;
    raises (one line) when there is none, it is incomplete, or it holds
    another model's state. Cheap: reads only the `COMPLETE` manifest."""
    meta = _checked_manifest(path, [job.view(s) for s in range(job.strategy.pp)])
    return meta["next_step"]


def _checked_manifest(path: str, views) -> dict:
    """`COMPLETE`'s manifest, once `check_resumable`'s checks pass for the
    states of `views` (a rank checks its own stage's)."""
    if not path:
        raise ConfigError("--resume needs --save-dir: the directory of the checkpoint to "
                          "continue from")
    root = Path(path)
    if not root.is_dir():
        raise RuntimeFault(f"checkpoint {path} does not exist; run with --save-dir {path} "
                           "first, or drop --resume")
    meta = read_marker(path, "resume from an earlier one or start afresh")
    saved = meta.get("state")
    step = meta.get("next_step")
    if not isinstance(saved, dict) or not isinstance(step, int):
        raise RuntimeFault(f"{root / COMPLETE} lacks the state manifest; save the checkpoint "
                           "again with this meshplan")
    for view in views:
        _check_states(path, view, saved)
    want = meta.get("metadata_sha256")
    if not (root / METADATA).is_file() or _metadata_hash(path) != want:
        raise RuntimeFault(f"checkpoint {path}: {METADATA} is missing or not the one saved "
                           "with it (edited or corrupted); resume from another checkpoint")
    return meta


def _check_states(path: str, view, saved: dict) -> None:
    """Each state of `view` is in the manifest `saved`, of its shape and dtype."""
    for name, vid in sorted(_state_values(view).items()):
        meta = view.values[vid].meta
        want = [list(meta.shape), meta.dtype.name]
        name = _saved_name(view, name, saved)
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


def read_marker(path: str | Path, fix: str) -> dict:
    """The sealed `COMPLETE` manifest of the checkpoint at `path`; one line
    ending in `fix` when it is incomplete (no marker: a run was stopped
    while saving) or the marker is damaged."""
    root = Path(path)
    if not (root / COMPLETE).is_file():
        raise RuntimeFault(f"checkpoint {path} is incomplete (no {COMPLETE} marker: a run was "
                           f"stopped while saving); {fix}")
    try:
        return read_sealed(root / COMPLETE, KIND, VERSION)
    except PlanError as e:  # its wording ("recompile it") is for plans
        what = str(e).split("; ")[0].removeprefix(str(root / COMPLETE)).lstrip(": ")
        raise RuntimeFault(f"checkpoint {path} has a damaged {COMPLETE} marker ({what}); "
                           f"{fix}") from None


def _saved_name(view, name: str, saved) -> str:
    """The name state `name` was saved under: itself, or an alias of a tied
    tensor (`head.weight@exp_avg` for `wte.weight@exp_avg`)."""
    state = StateName.parse(name) if is_state(name) else None
    for n in view.names_of(state.fqn if state else name):
        alias = str(StateName(n, state.slot)) if state else n
        if alias in saved:
            return alias
    return name


def read_slices(path: str) -> dict[str, torch.Tensor]:
    """Every state slice of a complete checkpoint (`<name>|<box>` -> tensor),
    read in this one process: what a run saved, for `verify`'s assembly."""
    meta = read_marker(path, "use another checkpoint")
    if _metadata_hash(path) != meta.get("metadata_sha256"):
        raise RuntimeFault(f"checkpoint {path}: {METADATA} is not the one saved with it")
    request = {}
    for key, md in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if "|" in key:
            request[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    shard_digests.load_verified(path, meta, request)
    return request


@dataclass(frozen=True, slots=True)
class Resumed:
    """What `load` restored besides the state: the step to resume at, the
    fp16 growth counter, and whether this rank's RNG states were restored
    (only from a checkpoint of the same Job and world)."""

    next_step: int
    good_steps: int = 0
    rng: bool = False


def load(path: str, state: dict, ctx, device=None) -> Resumed:
    """Fill this rank's state from the checkpoint, set the random ops' seed
    (`ctx.random`: their numbers do not depend on the layout), restore the
    rank's torch RNG states when the checkpoint was saved by this very Job
    (same digest, same world: only aten's own random ops, which meshplan
    does not rewrite, draw from them, and at another layout a rank's stream
    has no counterpart), and return the step to resume at and the fp16
    growth counter (0 in a checkpoint without one)."""
    meta = _checked_manifest(path, [ctx.view])
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    request, places = _requests(saved_boxes(path), state, ctx)
    request[STEP_KEY] = torch.tensor(0)
    for key in (GOOD_STEPS_KEY, SEED_KEY):
        if key in keys:
            request[key] = torch.tensor(0)
    rank, cuda = _rank(), device is not None and torch.device(device).type == "cuda"
    rng = {RNG_KEY.format(rank=rank)} | ({CUDA_RNG_KEY.format(rank=rank)} if cuda else set())
    same = meta.get("job") == ctx.view.digest and meta.get("world") == ctx.view.mesh.world
    rng = {k: torch.empty(tuple(keys[k].size), dtype=torch.uint8) for k in rng if k in keys} \
        if same else {}
    request |= rng
    shard_digests.load_verified(path, meta, request)
    _place(places, request, state, ctx)
    if SEED_KEY in request:
        ctx.random.seed = int(request[SEED_KEY])
    if RNG_KEY.format(rank=rank) in rng:
        torch.set_rng_state(rng[RNG_KEY.format(rank=rank)])
    if CUDA_RNG_KEY.format(rank=rank) in rng:
        torch.cuda.set_rng_state(rng[CUDA_RNG_KEY.format(rank=rank)], device)
    return Resumed(int(request[STEP_KEY]), int(request.get(GOOD_STEPS_KEY, 0)), bool(rng))


def _requests(saved: dict[str, list], state: dict, ctx) -> tuple[dict, list]:
    """The saved slices this rank's boxes intersect (`<name>|<box>` ->
    an empty tensor to load into), and where each part goes."""
    request, places, view = {}, [], ctx.view
    for name, vid in _state_values(view).items():
        if name not in state:
            continue
        want = ctx.box(vid)
        key_name = _saved_name(view, name, saved)
        if key_name not in saved:
            continue  # an optimizer slot not yet created (SGD momentum): start fresh
        for box in saved[key_name]:
            part = intersect(want, box) if box else ()
            if part is None:
                continue
            key = f"{key_name}|{box_key(box)}"
            if key not in request:
                shape = tuple(b - a for a, b in box)
                request[key] = torch.empty(shape, dtype=view.values[vid].meta.dtype.torch)
            places.append((name, vid, key, box, part))
    return request, places


def _place(places: list, request: dict, state: dict, ctx) -> None:
    """Copy each loaded part into this rank's state tensor at its box."""
    for name, vid, key, box, part in places:
        target = state[name]
        if target is None or tuple(target.shape) != tuple(b - a for a, b in ctx.box(vid)):
            shape = tuple(b - a for a, b in ctx.box(vid))
            target = state[name] = torch.empty(shape, dtype=request[key].dtype)
        mine = ctx.box(vid)
        dst = tuple(slice(a - m0, b - m0) for (a, b), (m0, _) in zip(part, mine))
        src = tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(part, box))
        target[dst] = request[key][src].to(target.device)


def load_weights(path: str, state: dict, ctx) -> None:
    """Fill this rank's parameters and buffers (not its optimizer slots, not
    the step) from the checkpoint at `path`, of any layout: `--init-from`."""
    meta = _checked_manifest(path, [ctx.view])
    kept = {v.name for v in ctx.view.values.values() if v.role in (Role.PARAM, Role.BUFFER)}
    weights = {name: t for name, t in state.items() if t is not None and name in kept}
    request, places = _requests(saved_boxes(path), weights, ctx)
    shard_digests.load_verified(path, meta, request)
    _place(places, request, weights, ctx)  # in place: `state` holds the same tensors


def saved_state(path: str) -> dict[str, list]:
    """State name -> [shape, dtype] of what the complete checkpoint at `path`
    holds (its manifest; one line if it is incomplete or damaged)."""
    state = read_marker(path, "use another checkpoint").get("state")
    if not isinstance(state, dict):
        raise RuntimeFault(f"checkpoint {path} lacks the state manifest; save it again with "
                           "this meshplan")
    return state


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
        shard_digests.load_verified(path, read_marker(path, "export another checkpoint"),
                                    request, no_dist=True)
    return full


def _volume(box: tuple) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n
