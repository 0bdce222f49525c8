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


def test_verbose_logs_and_quiet_silences_the_command(tmp_path):
    from tests.cli.test_cli import run

    args = ("compile", "--model", "gpt", "--devices-per-node", "2", "--pp", "2",
            "--num-microbatches", "2", "--out", str(tmp_path / "p"))
    loud = run("-v", *args)
    assert loud.returncode == 0, loud.stderr
    assert "INFO meshplan: lowering 2 ranks" in loud.stderr
    assert "lowering ranks: 2/2" in loud.stderr
    quiet = run("-q", *args)
    assert quiet.returncode == 0 and quiet.stderr == "" and "compiled 2 rank plans" in quiet.stdout
