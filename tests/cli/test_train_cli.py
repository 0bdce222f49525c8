"""`meshplan train` and `prepare-data` on bad input: one line on stderr,
exit 2, no traceback, and no run directory (or token directory) left."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from meshplan.cli.main import main

JSON_DIR = Path(sysconfig.get_paths()["stdlib"]) / "json"
TINY = ["--size", "tiny", "--devices-per-node", "1", "--tp", "1", "--pp", "1", "--vpp", "1",
        "--global-batch-size", "4", "--micro-batch-size", "4", "--steps", "2",
        "--warmup-steps", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens") / "data"
    assert main(["-q", "prepare-data", "--input", str(JSON_DIR / "*.py"), "--out",
                 str(out)]) == 0
    return out


def _one_line(capsys, argv: list[str], *words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("meshplan: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def test_an_empty_glob(tmp_path, capsys):
    _one_line(capsys, ["prepare-data", "--input", str(tmp_path / "none*.txt"), "--out",
                       str(tmp_path / "d")], "none*.txt")
    assert not (tmp_path / "d").exists()


def test_another_vocabulary_than_the_model(data, tmp_path, capsys):
    out = tmp_path / "run"
    _one_line(capsys, ["train", "--data", str(data), "--out", str(out), *TINY, "--vocab", "128"],
              "--vocab 128", "257")
    assert not out.exists()


def test_seq_len_longer_than_every_document(data, tmp_path, capsys):
    out = tmp_path / "run"
    _one_line(capsys, ["train", "--data", str(data), "--out", str(out), *TINY,
                       "--seq-len", "20000"], "longer than every document")
    assert not out.exists()


def test_an_unknown_config_key(data, tmp_path, capsys):
    (tmp_path / "run.toml").write_text('lerning_rate = 3e-4\n')
    out = tmp_path / "run"
    _one_line(capsys, ["train", "--config", str(tmp_path / "run.toml"), "--data", str(data),
                       "--out", str(out), *TINY], "lerning_rate", "lr")
    assert not out.exists()


@pytest.mark.parametrize("rate", ["0", "1", "-0.1"])
def test_a_mask_rate_outside_zero_to_one(data, tmp_path, capsys, rate):
    out = tmp_path / "run"
    _one_line(capsys, ["train", "--data", str(data), "--out", str(out), "--model", "bert",
                       *TINY, "--mask-rate", rate], "between 0 and 1")
    assert not out.exists()


@pytest.mark.parametrize("setting", ["steps", "steps=many", "nosuchkey=1"])
def test_a_set_that_does_not_parse(data, tmp_path, capsys, setting):
    out = tmp_path / "run"
    _one_line(capsys, ["train", "--data", str(data), "--out", str(out), *TINY, "--set",
                       setting], setting.split("=")[0])
    assert not out.exists()


def test_a_model_that_reads_no_tokens(data, tmp_path, capsys):
    out = tmp_path / "run"
    _one_line(capsys, ["train", "--data", str(data), "--out", str(out), "--model", "resnet",
                       *TINY], "reads token data into language models")
    assert not out.exists()


def test_a_directory_that_is_not_token_data(tmp_path, capsys):
    out = tmp_path / "run"
    _one_line(capsys, ["train", "--data", str(tmp_path), "--out", str(out), *TINY],
              "prepare-data")
    assert not out.exists()
