"""Progress of long steps (lowering ranks, training steps) on stderr.

Invariants:
- On a terminal (`stream.isatty()`) a step is a rich progress bar; elsewhere
  (CI logs, pipes) it is a few plain lines, one per tenth of the work and
  one at the end; with `-q` nothing at all.
- Progress never goes to stdout, so `--json` output stays one JSON object.
- An update is a plain call `update(done)`: the drivers take any callable
  and know nothing of this module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    """Where and how progress is shown; `Progress(quiet=True)` shows nothing."""

    def __init__(self, quiet: bool = False, stream=None):
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr

    @property
    def on_terminal(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    @contextmanager
    def task(self, label: str, total: int) -> Iterator[Callable[[int], None]]:
        """A step of `total` units; yields `update(done)`."""
        if self.quiet or total <= 0:
            yield lambda done: None
        elif self.on_terminal:
            with self._bar(label, total) as update:
                yield update
        else:
            yield self._lines(label, total)

    @contextmanager
    def _bar(self, label: str, total: int):
        bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), console=Console(file=self.stream),
                           transient=False)
        with bar:
            tid = bar.add_task(label, total=total)
            yield lambda done: bar.update(tid, completed=done)

    def _lines(self, label: str, total: int) -> Callable[[int], None]:
        shown = [-1]

        def update(done: int) -> None:
            tenth = 10 * done // total
            if tenth > shown[0]:
                shown[0] = tenth
                print(f"{label}: {done}/{total}", file=self.stream, flush=True)

        return update

    def line(self, text: str) -> None:
        """One line of narration (unless quiet)."""
        if not self.quiet:
            print(text, file=self.stream, flush=True)
