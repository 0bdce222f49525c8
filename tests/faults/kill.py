"""The compile fault, injected from the tests: a worker that lowers `rank`
kills itself (SIGKILL) after lowering it and before writing anything.
Compile workers are forked, so a patch made before `compile_job` is theirs."""

from __future__ import annotations

import os
import signal

from meshplan.plan.stage_files import StageFiles


def dying_plan_bytes(rank: int):
    """`StageFiles.plan_bytes` that kills its process once it has lowered `rank`."""
    plan_bytes = StageFiles.plan_bytes

    def lower_then_die(self, r: int):
        out = plan_bytes(self, r)
        if r == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    return lower_then_die


# `python -c CLI_KILLING_RANK_1 compile ...`: the `meshplan` command with the fault.
CLI_KILLING_RANK_1 = (
    "import sys; from meshplan.plan.stage_files import StageFiles; "
    "from tests.faults.kill import dying_plan_bytes; "
    "StageFiles.plan_bytes = dying_plan_bytes(1); "
    "from meshplan.cli.main import main; sys.exit(main())")
