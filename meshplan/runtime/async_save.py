"""Checkpoints saved in the background: `--async-checkpoint`.

Invariants (with `runtime/checkpoint.py`'s, whose staging, marker and
writer it shares):
- A rank stages fresh host copies (`checkpoint.stage(copy=True)`), then
  `dcp.async_save`s them on a gloo group of its own, in a thread, and trains
  on; DCP's own stager is bypassed (it would copy again).
- At most one save is in flight per rank; `COMPLETE` is written by rank 0
  once its save finished ([Note: rank 0's future]), at the next `poll` or
  `wait`, where the save's error, if any, is raised as this rank's.
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp

from meshplan.runtime import checkpoint


class AsyncSaver:
    """Saves in the background (`dcp.async_save` on a thread), at most one in
    flight: `start` waits for the previous one first. `poll` (called at each
    step) marks a finished save complete and raises its error, if any, as
    this rank's; `wait` does so without polling (before the next save, and at
    the run's end). `group` is a gloo group of every rank made once at setup,
    so the background collectives never interleave with training's on the
    default group; each of them is bounded by its timeout.

    [Note: rank 0's future] DCP's save ends with `all_reduce("write", ...)`:
    every rank writes its shard, waits for it, and sends its write results to
    rank 0, which writes `.metadata` (state_dict_saver `_save_state_dict`,
    utils `_DistWrapper.all_reduce`). So rank 0's future completes only after
    every rank's shard is written, and `COMPLETE` needs no further barrier."""

    def __init__(self, group=None):
        self.group = group
        self.pending: tuple | None = None  # (future, path, job, next_step, files)

    def start(self, path: str, staged: dict, job: checkpoint.SavedJob, next_step: int,
              files=()) -> None:
        """Wait for the save in flight, then start writing `staged` to `path`."""
        self.wait()
        checkpoint.unmark(path, self.group, staged)
        fut = dcp.async_save(staged, storage_writer=checkpoint.shard_writer(path, next_step),
                             process_group=self.group, async_stager=_AS_STAGED)
        self.pending = (fut, path, job, next_step, tuple(files))

    def poll(self) -> None:
        """Mark the save in flight complete if it has finished."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight (its error is raised here) and mark it."""
        if self.pending is None:
            return
        fut, path, job, next_step, files = self.pending
        self.pending = None
        fut.result()
        checkpoint.mark(path, job, next_step, files)


class _AsStaged:
    """An `AsyncStager` that keeps the dict it is given: `stage(copy=True)`
    already made the host copies (DCP's default stager would copy again)."""

    _synchronize_after_execute = False

    def stage(self, state_dict, **_):
        return state_dict

    def should_synchronize_after_execute(self) -> bool:
        return False

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


_AS_STAGED = _AsStaged()
