"""Kernel temp bytes (workspace): a physical fact of an op on local shapes.

Invariants:
- Only kinds whose rule has a `temp_bytes` function take workspace; every
  other kind takes none, by the table, with nothing to infer.
- The master works out each distinct (kind, local signature) once for the
  whole compile (`passes/temps.py`) and the Job carries the answers under
  `temp_key`; ranks only look them up. `TempStats.calls` counts the rule
  functions actually run, in this process.
"""

from __future__ import annotations

from typing import Any

from meshplan.ir import DType, TensorMeta
from meshplan.ops.table import rule_for


class TempStats:
    calls = 0

    @classmethod
    def snapshot(cls) -> dict[str, int]:
        return {"calls": cls.calls}


def has_temp(kind: str) -> bool:
    """Whether `kind` takes kernel workspace at all."""
    return rule_for(kind).temp_bytes is not None


def temp_bytes(kind: str, sig_args: tuple) -> int:
    """Workspace bytes of `kind` on arguments with signature `sig_args`."""
    fn = rule_for(kind).temp_bytes
    if fn is None:
        return 0
    TempStats.calls += 1
    return int(fn(sig_args))


def temp_key(kind: str, sig_args: tuple) -> str:
    """The Job's key of (kind, local signature): `kind(float32[8,3,32,32],1)`."""
    return f"{kind}({_fmt(sig_args)[1:-1]})"


def _fmt(a: Any) -> str:
    if isinstance(a, TensorMeta):
        return f"{a.dtype.name}[{','.join(map(str, a.shape))}]"
    if isinstance(a, DType):
        return a.name
    if isinstance(a, tuple):
        return "(" + ",".join(_fmt(x) for x in a) + ")"
    return repr(a)
