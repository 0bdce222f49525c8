"""Run the catalogue of bad inputs (`cases.py`).

Every command-line case must: exit 2 with exactly one line on stderr,
`meshplan: error: ...` holding the case's phrase, and no traceback; leave
the case's directory exactly as it was (no partial output); and, with
`--debug`, raise the case's error class instead. Every Python case must
raise its error class with the phrase in the message.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.cli.main import main
from tests.bad_inputs import files
from tests.bad_inputs.cases import CASES, Case


@pytest.fixture(scope="session")
def good(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good")
    files.make_plans(root / "plans")
    files.make_checkpoint(root / "ckpt")
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` with a hash of its bytes ("" for a directory)."""
    return {str(p.relative_to(root)): "" if p.is_dir() else
            hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))}


def prepare(case: Case, tmp: Path, request) -> dict[str, str]:
    subs = {"{tmp}": str(tmp)}
    for key, damage in (("plans", case.plans), ("ckpt", case.ckpt)):
        if damage is not None:
            d = files.copy_of(request.getfixturevalue("good") / key, tmp, key)
            damage(d)
            subs[f"{{{key}}}"] = str(d)
    return subs


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own exits (--help) only
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path, request, capsys, monkeypatch):
    subs = prepare(case, tmp_path, request)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    if case.call is not None:
        with pytest.raises(case.error) as info:
            case.call(tmp_path)
        assert case.phrase in str(info.value)
        return
    argv = list(case.argv)
    for key, value in subs.items():
        argv = [a.replace(key, value) for a in argv]
    before = snapshot(tmp_path)
    code, err = run_cli(argv, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("meshplan: error: ") and "Traceback" not in err
    assert case.phrase in lines[0], lines[0]
    assert snapshot(tmp_path) == before, "a failed command left files behind"
    with pytest.raises(case.error):
        main(["--debug", *argv])
    assert snapshot(tmp_path) == before


def test_the_catalogue_is_wide():
    cats: dict[str, int] = {}
    for c in CASES:
        cats[c.category] = cats.get(c.category, 0) + 1
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)
    assert {"strategy", "model", "capture", "layers", "schedule", "files", "checkpoint",
            "runtime", "config"} <= set(cats)


def test_debug_shows_the_traceback_in_a_real_process(tmp_path):
    """The in-process runs above show the one line; a real process with
    --debug shows the traceback instead (and still writes nothing)."""
    p = subprocess.run([sys.executable, "-m", "meshplan", "--debug", "plan", "--tp", "0"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode != 0 and "Traceback" in p.stderr
    assert "meshplan.errors.ConfigError: --tp 0 must be >= 1" in p.stderr
    assert list(tmp_path.iterdir()) == []
