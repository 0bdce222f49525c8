"""The `prepare-data` verb's flags and output, driven through argparse."""

import argparse
import io
import json

import pytest

from meshplan.cli.data_cmd import add_prepare_flags, cmd_prepare_data
from meshplan.cli.progress import Progress
from meshplan.errors import ConfigError


def run(argv, json_out=False):
    p = argparse.ArgumentParser()
    add_prepare_flags(p)
    a = p.parse_args(argv)
    a.json, a.progress = json_out, Progress(stream=io.StringIO())
    return cmd_prepare_data(a), a.progress.stream.getvalue()


def test_summary_json_and_progress(tmp_path, capsys):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document {i}\n")
    rc, progress = run(["--input", str(tmp_path / "*.txt"), "--out", str(tmp_path / "o"),
                        "--val-fraction", "0.3"])
    out = capsys.readouterr().out
    assert rc == 0 and "files: 3/3" in progress
    assert "tokenizer bytes, vocab 257" in out and "train" in out and "validation" in out
    rc, _ = run(["--input", str(tmp_path / "*.txt"), "--out", str(tmp_path / "o")], True)
    index = json.loads(capsys.readouterr().out)
    assert index["format"] == "meshplan.tokens" and index["val_fraction"] == 0.05


def test_defaults_and_a_missing_input(tmp_path):
    p = argparse.ArgumentParser()
    add_prepare_flags(p)
    a = p.parse_args(["--out", "x"])
    assert (a.tokenizer, a.val_fraction, a.text_field, a.hf_dataset) == ("bytes", 0.05,
                                                                         "text", None)
    with pytest.raises(ConfigError, match="--input GLOB... or --hf-dataset"):
        run(["--out", str(tmp_path / "o")])
