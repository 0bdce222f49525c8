"""`meshplan export` mistakes: each one line on stderr, exit 2, nothing
written (no --out, no temporary sibling). One tiny zoo-GPT run (byte
tokens, pp2) gives the checkpoint to damage."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from meshplan.cli.main import main

JSON_DIR = Path(sysconfig.get_paths()["stdlib"]) / "json"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export_cli")
    data, out = tmp / "data", tmp / "run"
    assert main(["-q", "prepare-data", "--input", str(JSON_DIR / "*.py"), "--out",
                 str(data)]) == 0
    assert main(["-q", "train", "--data", str(data), "--out", str(out), "--size", "tiny",
                 "--devices-per-node", "2", "--tp", "1", "--pp", "2", "--vpp", "1",
                 "--global-batch-size", "4", "--micro-batch-size", "2", "--steps", "2",
                 "--warmup-steps", "1",
                 "--checkpoint-every", "2", "--eval-every", "0", "--sample-tokens", "0"]) == 0
    return data, out


def _fails(capsys, tmp_path, src, *words, fmt="torch", extra=()):
    out = tmp_path / "out"
    assert main(["export", str(src), "--format", fmt, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("meshplan: error: "), err
    assert all(w in err for w in words), err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run_dir / "checkpoints" / "step_2", ckpt)
    return ckpt


@pytest.mark.slow
def test_a_run_directory_exports_its_newest_checkpoint(run, tmp_path, capsys):
    _, run_dir = run
    assert main(["export", str(run_dir), "--format", "torch", "--out", str(tmp_path / "o")]) == 0
    assert "step_2" in capsys.readouterr().out
    assert (tmp_path / "o" / "model.pt").is_file()


def test_not_a_directory(tmp_path, capsys):
    _fails(capsys, tmp_path, tmp_path / "nowhere", "not a directory")


@pytest.mark.slow
def test_incomplete(run, tmp_path, capsys):
    ckpt = _copy(run[1], tmp_path)
    (ckpt / "COMPLETE").unlink()
    _fails(capsys, tmp_path, ckpt, "incomplete", "COMPLETE")


@pytest.mark.slow
@pytest.mark.parametrize("name,words", [("COMPLETE", ("damaged", "COMPLETE")),
                                        (".metadata", (".metadata", "corrupted")),
                                        ("model.json", ("model.json", "corrupted"))])
def test_damaged(run, tmp_path, capsys, name, words):
    ckpt = _copy(run[1], tmp_path)
    data = bytearray((ckpt / name).read_bytes())
    data[len(data) // 2] ^= 1
    (ckpt / name).write_bytes(bytes(data))
    _fails(capsys, tmp_path, ckpt, *words)


@pytest.mark.slow
def test_hf_format_of_a_zoo_model(run, tmp_path, capsys):
    _fails(capsys, tmp_path, run[1], "gpt", "--format torch", fmt="hf")


@pytest.mark.slow
def test_an_existing_out_is_never_overwritten(run, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["export", str(run[1]), "--format", "torch", "--out",
                 str(tmp_path / "out")]) == 2
    assert "choose a new directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


@pytest.mark.slow
def test_a_bad_shard_size(run, tmp_path, capsys):
    _fails(capsys, tmp_path, run[1], "--max-shard-size", extra=("--max-shard-size", "lots"))


@pytest.mark.slow
def test_train_export_hf_of_a_zoo_model_is_refused_before_the_run(run, tmp_path, capsys):
    data, _ = run
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), "--size", "tiny",
                 "--devices-per-node", "2", "--tp", "1", "--pp", "2", "--vpp", "1",
                 "--steps", "1", "--warmup-steps", "0", "--export-hf",
                 str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--export-hf" in err and "--export-torch" in err
    assert not out.exists() and not (tmp_path / "hf").exists()
