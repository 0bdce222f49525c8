"""Faults injected from the tests, never from production code.

- Compile: a worker that lowers `rank` kills itself (SIGKILL) after lowering
  it and before writing anything. Compile workers are forked, so a patch made
  before `compile_job` is theirs.
- Run: a rank kills itself once it has finished some steps, or once its
  checkpoint shard is written. Rank processes come from a fork server, which
  a patch in the test process does not reach: the fault travels as the
  process target (`rank_entry_killing`, pickled by reference, patched over
  `launch.spawn_entry`) and patches the rank's own process.
"""

from __future__ import annotations

import functools
import os
import signal

from meshplan.lowering.stage_files import StageFiles


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def dying_plan_bytes(rank: int):
    """`StageFiles.files` that kills its process once it has made `rank`'s files."""
    files = StageFiles.files

    def lower_then_die(self, r: int):
        out = files(self, r)
        if r == rank:
            _die()
        return out

    return lower_then_die


# `python -c CLI_KILLING_RANK_1 compile ...`: the `meshplan` command with the fault.
CLI_KILLING_RANK_1 = (
    "import sys; from meshplan.lowering.stage_files import StageFiles; "
    "from tests.faults.kill import dying_plan_bytes; "
    "StageFiles.files = dying_plan_bytes(1); "
    "from meshplan.cli.main import main; sys.exit(main())")


def rank_entry_killing(rank: int, after_steps: int = -1, in_save: bool = False):
    """A `worker.spawn_entry` whose rank `rank` kills itself once it has
    finished `after_steps` steps (as its next step starts), or once its
    checkpoint shard is written (`in_save`: before the closing barrier, so
    rank 0 never marks the checkpoint complete)."""
    return functools.partial(_entry, rank, after_steps, in_save)


def _entry(kill_rank: int, after_steps: int, in_save: bool, spec_json: str, rank: int, *rest):
    from meshplan.runtime import checkpoint
    from meshplan.runtime.rank_executor import RankExecutor
    from meshplan.runtime.worker import spawn_entry

    if rank == kill_rank and after_steps >= 0:
        step, started = RankExecutor.step, [0]

        def step_or_die(self, *args, **kwargs):
            if started[0] == after_steps:
                _die()
            started[0] += 1
            return step(self, *args, **kwargs)

        RankExecutor.step = step_or_die
    if rank == kill_rank and in_save:
        save = checkpoint.dcp.save

        def save_then_die(*args, **kwargs):
            save(*args, **kwargs)
            _die()

        checkpoint.dcp.save = save_then_die
    return spawn_entry(spec_json, rank, *rest)
