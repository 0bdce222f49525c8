"""`torchrun ... tests/faults/disagree.py <meshplan args>`: the `meshplan`
command whose rank 5 lowers a plan with one send's piece cut short (a
disagreement with its peer, planted in one rank's plan only)."""

from __future__ import annotations

import os
import sys

from meshplan.runtime import own_plan
from tests.runtime.agreement_ranks import plant

if __name__ == "__main__":
    lower = own_plan.lower

    def planted(view, rank, device_type="cpu"):
        plan = lower(view, rank, device_type)
        return plant(plan, "box") if rank == int(os.environ.get("BAD_RANK", "5")) else plan

    own_plan.lower = planted
    from meshplan.cli.main import main
    sys.exit(main())
