"""The token directory format: hand-written directories read back, and
every refusal one ConfigError line naming the path and the fix."""

import json

import numpy as np
import pytest

from meshplan.data.tokens import TokenData, TokenWriter, dtype_for, is_token_dir
from meshplan.errors import ConfigError


def write_dir(path, train, validation=(), vocab=257, eod=256, **changes):
    """A token directory written by hand (not by TokenWriter)."""
    path.mkdir(parents=True, exist_ok=True)
    splits = {}
    for name, toks in (("train", train), ("validation", validation)):
        arr = np.asarray(toks, dtype="<u2")
        arr.tofile(path / f"{name}.bin")
        ends = [i for i, t in enumerate(toks) if t == eod]
        lengths = np.diff([-1] + ends).tolist() if ends else [0]
        splits[name] = {"documents": len(ends), "tokens": len(toks),
                        "longest_document": max(lengths)}
    index = {"format": "meshplan.tokens", "version": 1, "dtype": "uint16",
             "vocab_size": vocab, "eod": eod, "tokenizer": {"kind": "bytes"},
             "splits": splits, "sources": ["hand"], "val_fraction": 0.1}
    index.update(changes)
    (path / "index.json").write_text(json.dumps(index))
    return path


def test_a_hand_written_directory_reads_back(tmp_path):
    d = write_dir(tmp_path / "d", [1, 2, 3, 256, 4, 5, 256], [7, 256])
    data = TokenData(d)
    assert isinstance(data.tokens, np.memmap) and data.tokens.dtype == np.dtype("<u2")
    assert data.tokens.tolist() == [1, 2, 3, 256, 4, 5, 256]
    assert (data.vocab_size, data.eod, data.longest_document) == (257, 256, 4)
    assert data.index["sources"] == ["hand"]
    with pytest.raises(ValueError):  # read-only
        data.tokens[0] = 9
    assert TokenData(d, "validation").tokens.tolist() == [7, 256]
    assert is_token_dir(d) and not is_token_dir(tmp_path)


def test_an_empty_split_is_an_empty_array(tmp_path):
    d = write_dir(tmp_path / "d", [1, 256], [])
    assert len(TokenData(d, "validation")) == 0


def test_dtype_follows_the_vocabulary():
    assert dtype_for(65536) == np.dtype("<u2") and dtype_for(65537) == np.dtype("<u4")


def test_the_writer_matches_the_format(tmp_path):
    with TokenWriter(tmp_path, vocab_size=70000, eod=69999) as w:
        w.add("train", [1, 66000])
        w.add("validation", [])
        w.add("train", [5])
        index = w.finish({"kind": "x"}, ["s"], 0.5)
    assert index["dtype"] == "uint32"
    assert index["splits"]["train"] == {"documents": 2, "tokens": 5, "longest_document": 3}
    assert np.fromfile(tmp_path / "train.bin", "<u4").tolist() == [1, 66000, 69999, 5, 69999]
    assert TokenData(tmp_path, "validation").tokens.tolist() == [69999]


@pytest.mark.parametrize("damage, words", [
    ("none", "not a token directory"),
    ("format", "not a meshplan token index"),
    ("version", "version 7"),
    ("size", "index.json says 3"),
    ("missing", "is missing"),
    ("json", "cannot be read"),
])
def test_a_bad_directory_is_one_line_naming_it_and_the_fix(tmp_path, damage, words):
    d = tmp_path / "d"
    if damage == "none":
        d.mkdir()
    else:
        write_dir(d, [1, 2, 256])
    if damage == "format":
        write_dir(d, [1, 2, 256], format="other")
    elif damage == "version":
        write_dir(d, [1, 2, 256], version=7)
    elif damage == "size":
        (d / "train.bin").write_bytes(b"\0" * 4)
    elif damage == "missing":
        (d / "train.bin").unlink()
    elif damage == "json":
        (d / "index.json").write_text("{")
    with pytest.raises(ConfigError) as e:
        TokenData(d)
    msg = str(e.value)
    assert words in msg and str(d) in msg and "prepare" in msg and "\n" not in msg


def test_check_seq_len(tmp_path):
    d = write_dir(tmp_path / "d", [1, 2, 256, 1, 2, 3, 4, 256], [1, 256])
    TokenData(d).check_seq_len(4)  # the longest document has 5 tokens
    with pytest.raises(ConfigError, match=r"seq_len 5 is longer than every document .* 5 tokens"):
        TokenData(d).check_seq_len(5)
    with pytest.raises(ConfigError, match=r"has 2 tokens, fewer than one sample of "
                                          r"seq_len\+1 = 3"):
        TokenData(d, "validation").check_seq_len(2)


def test_release_keeps_reads_valid(tmp_path):
    d = write_dir(tmp_path / "d", list(range(100)) + [256])
    data = TokenData(d)
    view = data.tokens[10:20]
    data.release()
    assert view.tolist() == list(range(10, 20)) and data.tokens[-1] == 256
