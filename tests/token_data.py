"""Token directories for tests: real text every machine has, the Python
standard library's `json` package, prepared as `meshplan prepare-data` does."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from meshplan.cli.main import main


def stdlib_sources(n: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"]) / "json"
    return [str(root / name) for name in ("__init__.py", "decoder.py", "encoder.py",
                                          "scanner.py", "tool.py")][:n]


def prepare(out: Path, sources: list[str], *flags: str) -> str:
    """`meshplan prepare-data` of `sources` into `out` (byte tokens unless
    `flags` say otherwise); returns `out` as a string."""
    assert main(["-q", "prepare-data", "--input", *sources, "--out", str(out), *flags]) == 0
    return str(out)


def pairs_jsonl(path: Path, n: int) -> list[dict]:
    """`n` pairs of real text written to the JSONL file `path`: each a line
    of the `json` package's sources (`text`) and that line in upper case
    (`target`), a task a tiny model starts to learn in a few hundred steps."""
    import json

    lines = [line.strip() for f in stdlib_sources(5) for line in Path(f).read_text().splitlines()
             if len(line.strip()) > 8][:n]
    rows = [{"text": line, "target": line.upper()} for line in lines]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
