"""The pass manager: one ordered list of named passes, run in order.

A pass reads and writes one state object (the compile in progress). It
declares the facts it `requires` of the state and the facts it `ensures`.

Invariants:
- The order is checked when the manager is built (`passes/plan.py` builds
  the one list at import): a pass whose requirement no earlier pass ensures,
  or a name given twice, raises `PassOrderError` there, naming both.
- A run may `skip` passes (their facts are the caller's to have made: a
  train step given by hand skips precision and autodiff) and stop after a
  named pass (`stop_after`); the passes that run keep the list's order.
- A pass whose `when` is false for the state has nothing to do and is not
  run; its facts still hold.
- `timings` gets the seconds of each pass that ran, under its name.
- With checks on (`checks=True`, or `MESHPLAN_CHECKS=1` in the environment)
  the manager's `check` (the IR invariant check) runs after every pass that ran; a
  failure names the pass. With checks off the run costs two clock reads a
  pass.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class PassOrderError(Exception):
    """The pass list is misordered: an internal error, raised at import."""


@dataclass(frozen=True, slots=True)
class Pass:
    """A named step of the compile: `fn(state)` updates the state in place."""

    name: str
    fn: Callable
    requires: frozenset[str] = frozenset()
    ensures: frozenset[str] = frozenset()
    when: Callable | None = None  # state -> bool: False when there is nothing to do


class PassManager:
    """An ordered list of passes, checked once, run as often as asked."""

    def __init__(self, passes: Iterable[Pass], check: Callable):
        self.passes = tuple(passes)
        self.check = check  # state -> None; raises AssertionError on a broken state
        ensured_by: dict[str, str] = {}
        names: set[str] = set()
        for p in self.passes:
            if p.name in names:
                raise PassOrderError(f"pass '{p.name}' is listed twice")
            names.add(p.name)
            missing = sorted(p.requires - ensured_by.keys())
            if missing:
                later = {f: q.name for q in self.passes for f in q.ensures}
                why = ", ".join(f"'{f}' (ensured by {later[f]!r})" if f in later
                                else f"'{f}' (ensured by no pass)" for f in missing)
                raise PassOrderError(f"pass '{p.name}' requires {why}, not ensured before "
                                     f"it; move it after the pass that ensures each")
            for f in p.ensures:
                ensured_by.setdefault(f, p.name)
        self.names = tuple(p.name for p in self.passes)

    def run(self, state, *, skip: Iterable[str] = (), stop_after: str | None = None,
            checks: bool | None = None, timings: dict | None = None):
        """Run the passes on `state` (in place; returned), in order, but for
        `skip`, up to `stop_after` (a name) if given."""
        skip = frozenset(skip)
        unknown = sorted(skip - set(self.names)) + (
            [stop_after] if stop_after is not None and stop_after not in self.names else [])
        assert not unknown, f"no pass named {unknown}; the passes are {self.names}"
        if checks is None:
            checks = os.environ.get("MESHPLAN_CHECKS", "") == "1"
        timings = {} if timings is None else timings
        for p in self.passes:
            if p.name not in skip and (p.when is None or p.when(state)):
                t = time.perf_counter()
                p.fn(state)
                timings[p.name] = time.perf_counter() - t
                if checks:
                    self._check_after(p, state)
            if p.name == stop_after:
                break
        return state

    def _check_after(self, p: Pass, state) -> None:
        try:
            self.check(state)
        except AssertionError as e:
            raise AssertionError(f"after pass '{p.name}': {e}") from e
