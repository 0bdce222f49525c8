"""Kernel temp bytes (workspace), asked only by physical lowering.

Invariant: computed from the op's argument signature and cached by it, so a
layer repeated 96 times, or asked by many ranks, is computed once; `TempStats`
counts calls and cache hits for the compile statistics.
"""

from __future__ import annotations

from functools import cache

from meshplan.ops.table import rule_for


class TempStats:
    calls = 0
    misses = 0

    @classmethod
    def snapshot(cls) -> dict[str, int]:
        return {"calls": cls.calls, "cache_hits": cls.calls - cls.misses}


def temp_bytes(kind: str, sig_args: tuple) -> int:
    """Workspace bytes of `kind` on arguments with signature `sig_args`."""
    TempStats.calls += 1
    return _temp_cached(kind, sig_args)


@cache
def _temp_cached(kind: str, sig_args: tuple) -> int:
    TempStats.misses += 1
    fn = rule_for(kind).temp_bytes
    return int(fn(sig_args)) if fn is not None else 0

