"""prepare_data: round trips, a BPE on the standard library's own source,
jsonl and HF dataset inputs, the deterministic split, and every error one
ConfigError line that leaves nothing behind."""

import glob
import json
import os
import sysconfig

import pytest

from meshplan.data.prepare import goes_to_validation, prepare_data
from meshplan.data.tokenizer import load_tokenizer
from meshplan.data.tokens import TokenData
from meshplan.errors import ConfigError

DOCS = ["first document\n", "zweites Dokument: äöü\n", "third 🚀", "fourth\n" * 3, "5"]


@pytest.fixture
def texts(tmp_path):
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    for i, d in enumerate(DOCS):
        (src / ("sub" if i % 2 else "") / f"{i}.txt").write_text(d)
    (src / "empty.txt").write_text("")
    return src


def split_texts(out):
    """Each split's documents, decoded (split on eod)."""
    tok = load_tokenizer(out)
    result = {}
    for split in ("train", "validation"):
        ids, docs, cur = TokenData(out, split).tokens.tolist(), [], []
        for i in ids:
            if i == tok.eod:
                docs.append(tok.decode(cur))
                cur = []
            else:
                cur.append(i)
        result[split] = docs
    return result


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_bytes_round_trip_in_reading_order(texts, tmp_path):
    calls = []
    index = prepare_data([str(texts / "*.txt"), str(texts / "**/*.txt")], str(tmp_path / "o"),
                         val_fraction=0.4, progress=lambda d, t: calls.append((d, t)))
    got = split_texts(tmp_path / "o")
    order = [DOCS[0], DOCS[2], DOCS[4], DOCS[1], DOCS[3]]  # *.txt sorted, then sub/ (once each)
    assert sorted(got["train"] + got["validation"]) == sorted(DOCS)
    assert got["train"] == [d for d in order if d in got["train"]]
    assert got["train"] and got["validation"]
    assert calls == [(i, 6) for i in range(1, 7)] and len(index["sources"]) == 6
    assert index["splits"]["train"]["documents"] == len(got["train"])
    assert index["splits"]["train"]["tokens"] == sum(len(d.encode()) + 1 for d in got["train"])
    assert leftovers(tmp_path) == []


def test_the_split_is_deterministic_and_reaches_both_sides(texts, tmp_path):
    a = prepare_data([str(texts / "**/*.txt")], str(tmp_path / "a"))
    b = prepare_data([str(texts / "**/*.txt")], str(tmp_path / "b"))
    assert a["splits"] == b["splits"]
    for split in ("train", "validation"):
        assert (tmp_path / "a" / f"{split}.bin").read_bytes() == \
            (tmp_path / "b" / f"{split}.bin").read_bytes()
    assert a["splits"]["validation"]["documents"] >= 1  # 5 documents at 5%
    expect = [k for k in range(1000) if goes_to_validation(k, 0.25)]
    assert 200 < len(expect) < 300 and expect == [k for k in range(1000)
                                                  if goes_to_validation(k, 0.25)]
    none = prepare_data([str(texts / "**/*.txt")], str(tmp_path / "c"), val_fraction=0)
    assert none["splits"]["validation"] == {"documents": 0, "tokens": 0, "longest_document": 0}


def test_bpe_on_the_standard_library(tmp_path):
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:20]
    index = prepare_data(files, str(tmp_path / "o"), tokenizer="bpe:800")
    assert (tmp_path / "o" / "tokenizer.json").is_file()
    assert index["tokenizer"]["kind"] == "bpe" and 300 < index["vocab_size"] <= 800
    tok = load_tokenizer(tmp_path / "o")
    assert tok.decode(tok.encode("import os\n")) == "import os\n"
    train = TokenData(tmp_path / "o")
    assert int(train.tokens.max()) < index["vocab_size"]
    first = open(files[0], encoding="utf-8").read()
    assert tok.decode(train.tokens[:len(tok.encode(first))]) == first


def test_jsonl_input(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "one"}\n\n{"body": "two", "x": 1}\n'
                                      '{"body": ""}\n{"body": "three"}\n')
    prepare_data([str(tmp_path / "a.jsonl")], str(tmp_path / "o"), text_field="body",
                 val_fraction=0)
    assert split_texts(tmp_path / "o")["train"] == ["one", "two", "three"]


def test_a_local_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"t": ["alpha", "beta", "", "gamma"]}).save_to_disk(
        str(tmp_path / "ds"))
    index = prepare_data([], str(tmp_path / "o"), text_field="t", hf_dataset=str(tmp_path / "ds"),
                         val_fraction=0)
    assert split_texts(tmp_path / "o")["train"] == ["alpha", "beta", "gamma"]
    assert index["sources"] == [str(tmp_path / "ds")]
    with pytest.raises(ConfigError, match="no column 'text' .* --text-field"):
        prepare_data([], str(tmp_path / "p"), hf_dataset=str(tmp_path / "ds"))
    assert not (tmp_path / "p").exists()


def test_a_missing_datasets_library_is_one_line(monkeypatch, tmp_path):
    from tests.data.test_tokenizer import without

    without(monkeypatch, "datasets")
    with pytest.raises(ConfigError, match="needs the datasets library: pip install datasets"):
        prepare_data([], str(tmp_path / "o"), hf_dataset=str(tmp_path))
    assert leftovers(tmp_path) == [] and not (tmp_path / "o").exists()


def bad_jsonl(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    return [str(tmp_path / "b.jsonl")]


def no_field(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    return [str(tmp_path / "b.jsonl")]


def empty_files(tmp_path):
    (tmp_path / "e.txt").write_text("")
    (tmp_path / "e.jsonl").write_text("\n")
    return [str(tmp_path / "e.*")]


@pytest.mark.parametrize("make, words", [
    (lambda p: [str(p / "nothing*.txt")], "nothing*.txt matches no file"),
    (empty_files, "hold no text"),
    (bad_jsonl, "b.jsonl:2: not JSON"),
    (no_field, "b.jsonl:2: no string field 'text'"),
])
@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_an_error_leaves_nothing_behind(tmp_path, make, words, tokenizer):
    inputs = make(tmp_path)
    out = tmp_path / "new" / "deeper" / "o"
    with pytest.raises(ConfigError, match="^[^\n]*$") as e:
        prepare_data(inputs, str(out), tokenizer=tokenizer)
    assert words in str(e.value)
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []


def test_an_unreadable_file_midway_keeps_the_old_directory(texts, tmp_path):
    out = tmp_path / "o"
    prepare_data([str(texts / "*.txt")], str(out), val_fraction=0)
    before = (out / "train.bin").read_bytes()
    victim = sorted(texts.glob("*.txt"))[2]

    def delete_next(done, total):  # the next file vanishes between glob and read
        if done == 2:
            os.remove(victim)

    with pytest.raises(ConfigError, match=f"cannot read {victim} .* leave it out of --input"):
        prepare_data([str(texts / "*.txt")], str(out), val_fraction=0, progress=delete_next)
    assert (out / "train.bin").read_bytes() == before and leftovers(tmp_path) == []
    index = prepare_data([str(texts / "2.txt")], str(out), val_fraction=0)  # replaced
    assert index["splits"]["train"]["documents"] == 1
    assert json.loads((out / "index.json").read_text()) == index


def test_out_and_flag_checks(texts, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="busy is a non-empty directory that is not a token"):
        prepare_data([str(texts / "*.txt")], str(tmp_path / "busy"))
    assert os.listdir(tmp_path / "busy") == ["keep.txt"]
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match=r"must be in \[0, 1\)"):
            prepare_data([str(texts / "*.txt")], str(tmp_path / "o"), val_fraction=bad)
    with pytest.raises(ConfigError, match="bpe:4096"):
        prepare_data([str(texts / "*.txt")], str(tmp_path / "o"), tokenizer="bpe:x")
    (tmp_path / "empty").mkdir()
    prepare_data([str(texts / "*.txt")], str(tmp_path / "empty"))
    assert TokenData(tmp_path / "empty").index["splits"]["train"]["documents"] >= 1
    assert leftovers(tmp_path) == []
