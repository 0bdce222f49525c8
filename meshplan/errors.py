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


class KernelFault(RuntimeFault):
    """A kernel failed at run time: one line with the op, its module path and
    source line. Exit 2 when the model's input is at fault (an index out of
    range: the data or the config), 1 for meshplan's own fault."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class TrainingHalted(RuntimeFault):
    """A step's gradient norm was not finite under `--on-nonfinite halt`: the
    run stopped before applying it (the message names the step)."""

    exit_code = 1
