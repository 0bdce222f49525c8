"""One exception family for every user-facing failure.

Invariant: a `MeshplanError` message is one line that says what went wrong,
where (model, op, module path, rank, micro-batch) and how to fix it. The CLI
prints it without a traceback and exits with code 2. Internal invariants use
`assert`, never these classes.
"""


class MeshplanError(Exception):
    """Base class of every error a user can cause and fix."""

    exit_code = 2


class ConfigError(MeshplanError):
    """A model size, strategy or flag that cannot work."""


class CaptureError(MeshplanError):
    """The model cannot be captured or differentiated."""


class PlanError(MeshplanError):
    """A plan, plan file or job that is inconsistent or unreadable."""


class ScheduleError(MeshplanError):
    """A pipeline schedule that cannot be built for the given counts."""


class RuntimeFault(MeshplanError):
    """A failure while running plans: a rank died, a world size mismatched."""


class TrainingHalted(RuntimeFault):
    """A step's gradient norm was not finite under `--on-nonfinite halt`: the
    run stopped before applying it (the message names the step)."""

    exit_code = 1
