"""Progress: a rich bar on a terminal, plain lines elsewhere, nothing with -q."""

import io

from meshplan.cli.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(p: Progress, total: int = 40) -> None:
    with p.task("lowering ranks", total) as update:
        for k in range(1, total + 1):
            update(k)


def test_plain_lines_off_a_terminal():
    out = io.StringIO()
    _drive(Progress(stream=out))
    lines = out.getvalue().splitlines()
    assert lines[-1] == "lowering ranks: 40/40" and 5 <= len(lines) <= 11


def test_a_bar_on_a_terminal():
    out = Terminal()
    _drive(Progress(stream=out))
    assert "lowering ranks" in out.getvalue() and "40/40" in out.getvalue()


def test_quiet_shows_nothing():
    for stream in (io.StringIO(), Terminal()):
        p = Progress(quiet=True, stream=stream)
        _drive(p)
        p.line("narration")
        assert stream.getvalue() == ""
