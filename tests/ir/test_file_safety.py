"""Files: every file meshplan writes goes through `write_atomic`, plan, Job,
cache and checkpoint-marker files are sealed (format, version, sha256), and
nothing is ever unpickled from them. Checked on the source, so a new writer
or loader cannot slip in unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

import meshplan

ROOT = Path(meshplan.__file__).parent
ATOMIC_HOME = ROOT / "ir" / "fileio.py"  # the one place that opens files for writing


def calls():
    """(file, line, dotted callee, call node) of every call in meshplan/."""
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                yield path, node.lineno, ast.unparse(node.func), node


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT.parent)}:{line}"


UNSAFE = ("pickle", "marshal", "shelve", "dill", "cloudpickle")


def test_nothing_is_unpickled():
    bad = [where(p, n) for p, n, f, _ in calls() if f.split(".")[0] in UNSAFE]
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [where(path, node.lineno) for x in names if x.split(".")[0] in UNSAFE]
    assert not bad, bad


def test_torch_load_only_with_weights_only():
    bad = []
    for p, n, f, node in calls():
        if f == "torch.load":
            kw = {k.arg: k.value for k in node.keywords}
            flag = kw.get("weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                bad.append(where(p, n))
    assert not bad, f"torch.load without weights_only=True at {bad}"


def _writes(mode) -> bool:
    return isinstance(mode, ast.Constant) and bool(set(str(mode.value)) & set("wax+"))


def test_every_write_is_atomic():
    """Only `write_atomic` opens a file for writing; no write_text,
    write_bytes, torch.save or open(..., 'w') anywhere else."""
    bad = []
    for p, n, f, node in calls():
        if p == ATOMIC_HOME:
            continue
        name = f.split(".")[-1]
        modes = node.args[1:2] + [k.value for k in node.keywords if k.arg == "mode"]
        if (name in ("write_text", "write_bytes") or f == "torch.save"
                or name in ("open", "fdopen") and any(_writes(m) for m in modes)):
            bad.append(f"{where(p, n)} {f}")
    assert not bad, bad


def test_files_read_back_are_sealed(tmp_path):
    """Jobs, rank plans, graphs (the capture cache) and the checkpoint marker
    are sealed envelopes: format, version, sha256 of the body."""
    from meshplan.ir.serialize import graph_to_bytes
    from meshplan.lowering.files import plan_files
    from meshplan.runtime.checkpoint import COMPLETE
    from tests.bad_inputs.files import make_checkpoint
    from tests.lowering.jobs import job_of, plans_of

    job = job_of("gpt_interleaved")
    make_checkpoint(tmp_path / "ckpt")
    files = {"meshplan.job": job.to_bytes(), "meshplan.rankplan":
             plan_files(plans_of("gpt_interleaved")[0], job)[0], "meshplan.planclass":
             plan_files(plans_of("gpt_interleaved")[0], job)[2], "meshplan.graph":
             graph_to_bytes(job.graph), "meshplan.checkpoint":
             (tmp_path / "ckpt" / COMPLETE).read_bytes()}
    for kind, data in files.items():
        head = data[:120]
        assert head.startswith(b'{"format":"' + kind.encode() + b'","version":'), kind
        assert b'"sha256":"' in head, kind
