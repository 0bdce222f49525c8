"""Paired data (`prepare-data --target-field`, `data/pairs.py`): the
directory's pairs read back as written, cut and padded as documented, the
same rows at any layout, and each mistake one line."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest

from meshplan.cli.main import main
from meshplan.data.feed import FeedReader, Layout, TokenFeed
from meshplan.data.masking import IGNORE_INDEX
from meshplan.data.pairs import PairReader, joined, source_target
from meshplan.data.prepare import prepare_data
from meshplan.data.tokens import TokenData, idx_path
from meshplan.driver.train_model import sized_config, unigram_entropy
from meshplan.errors import ConfigError
from tests.token_data import pairs_jsonl

EOD, PAD = 256, 257


def pair(source: str, target: str) -> tuple[np.ndarray, np.ndarray]:
    """A pair as the byte tokenizer writes it: each part followed by eod."""
    return tuple(np.array([*t.encode(), EOD], dtype=np.int64) for t in (source, target))


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> tuple[str, list[dict]]:
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    return str(path), pairs_jsonl(path, 60)


@pytest.fixture(scope="module")
def data(rows, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("pairs") / "data")
    prepare_data([rows[0]], out, val_fraction=0.2, target_field="target")
    return out


def test_every_pair_reads_back_as_written(rows, data):
    written = [pair(r["text"], r["target"]) for r in rows[1]]
    got = []
    for split in ("train", "validation"):
        d = TokenData(data, split)
        assert d.pairs == {"source": "text", "target": "target"}
        assert d.ends.shape == (d.documents, 2) and d.documents > 0
        r = PairReader(d, 16, 0, shuffle=False)
        got += r.read(np.arange(d.documents))
    assert len(got) == len(written)
    # each written pair is read back exactly once, whichever split it went to
    key = {(tuple(s), tuple(t)) for s, t in written}
    assert {(tuple(s), tuple(t)) for s, t in got} == key


def test_an_encoder_decoders_rows_are_cut_and_padded():
    long = "x" * 30
    x, y = source_target([pair("ab", long), pair(long, "c")], 8, PAD)
    assert x[0].tolist() == [97, 98, EOD, PAD, PAD, PAD, PAD, PAD]
    assert y[0].tolist() == [120] * 7 + [EOD]  # cut, its eod kept
    assert x[1].tolist() == [120] * 7 + [EOD]
    assert y[1].tolist() == [99, EOD] + [IGNORE_INDEX] * 6
    # targets of a length of their own (an encoder-decoder's --target-len)
    x, y = source_target([pair("ab", long)], 8, PAD, target_len=4)
    assert x.shape == (1, 8) and y[0].tolist() == [120] * 3 + [EOD]


def test_a_causal_lms_rows_label_the_target_only():
    pairs = [pair("ab", "cd"), pair("x" * 30, "yz"), pair("p", "q" * 30)]
    x, y = joined(pairs, 8, EOD, shifted=False)
    assert x[0].tolist() == [97, 98, EOD, 99, 100, EOD, EOD, EOD]
    assert y[0].tolist() == [IGNORE_INDEX] * 2 + [99, 100, EOD] + [IGNORE_INDEX] * 3
    # a long source is cut first, to make room for the target, its eod kept
    assert x[1].tolist() == [120] * 5 + [EOD, 121, 122]
    assert y[1].tolist() == [IGNORE_INDEX] * 5 + [121, 122, EOD]
    # a long target: the source kept whole, the target cut
    assert y[2].tolist() == [IGNORE_INDEX] + [113] * 7
    # a model that shifts its labels itself: the same tokens, in place
    xs, ys = joined(pairs, 8, EOD, shifted=True)
    for row in range(3):
        learned = ys[row][ys[row] >= 0]
        assert (xs[row][ys[row] >= 0] == learned).all() and len(learned) >= 1


def test_a_source_longer_than_the_row_keeps_half_of_it():
    x, y = joined([pair("s" * 40, "t" * 40)], 16, EOD, shifted=False)
    assert x[0].tolist() == [115] * 7 + [EOD] + [116] * 8  # half the 17 positions
    assert (y[0] >= 0).sum() == 9


@pytest.mark.parametrize("layout", [Layout.SOURCE_TARGET, Layout.JOINED, Layout.JOINED_SHIFTED])
def test_any_rows_of_any_micro_batch_read_as_the_whole_batch(data, layout):
    feed = TokenFeed(data, "train", 12, 5, layout, pad_id=PAD)
    whole = FeedReader(feed, 8, 2)
    for step in range(3):
        parts = whole.microbatches(step)
        for lo, hi in ((0, 2), (2, 4), (1, 3)):
            mine = FeedReader(feed, 8, 2).microbatches(step, (lo, hi))
            for (x, y), (xm, ym) in zip(parts, mine):
                assert (x[lo:hi] == xm).all() and (y[lo:hi] == ym).all()


def test_a_pair_with_an_empty_target_is_skipped(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"text": "a", "target": ""}, {"text": "", "target": "b"}, {"text": "c", "target": "d"}]))
    index = prepare_data([str(path)], str(tmp_path / "o"), val_fraction=0,
                         target_field="target")
    assert index["splits"]["train"]["documents"] == 2
    assert idx_path(tmp_path / "o", "train").stat().st_size == 2 * 2 * 8


@pytest.mark.parametrize("make, words", [
    (lambda p: p.with_suffix(".txt").write_text("plain text"),
     "--target-field reads pairs from .jsonl files"),
    (lambda p: p.write_text(json.dumps({"text": "a"})),
     "no string field 'target'; give the field that holds the text with --target-field"),
])
def test_a_mistake_is_one_line(tmp_path, make, words):
    path = tmp_path / "p.jsonl"
    make(path)
    given = str(path if path.exists() else path.with_suffix(".txt"))
    with pytest.raises(ConfigError, match=words):
        prepare_data([given], str(tmp_path / "o"), target_field="target")
    assert not (tmp_path / "o").exists()  # nothing left behind


def test_pairs_and_text_do_not_mix(data, tmp_path):
    with pytest.raises(ConfigError, match="holds pairs, and this model reads text"):
        FeedReader(TokenFeed(data, "train", 12, 0, Layout.NEXT_TOKEN), 8, 1)
    with pytest.raises(ConfigError, match="holds pairs .* masked LM"):
        sized_config("bert", "tiny", data, {})


def test_a_damaged_index_of_ends_is_refused(data, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    ends = idx_path(copy, "train")
    ends.write_bytes(ends.read_bytes()[:-16])
    with pytest.raises(ConfigError, match="train.idx has .* bytes, but index.json says"):
        TokenData(copy, "train")
    raw = np.fromfile(idx_path(data, "train"), dtype="<u8")
    raw[-1] += 1
    raw.tofile(ends)
    with pytest.raises(ConfigError, match="does not end at the split's"):
        TokenData(copy, "train")


def test_an_epoch_reads_every_pair_once_in_the_seeded_order(data):
    d = TokenData(data, "train")
    ids = PairReader(d, 16, 7).sample_ids(np.arange(d.documents))
    assert sorted(ids.tolist()) == list(range(d.documents))
    assert ids.tolist() != list(range(d.documents))  # shuffled
    read = PairReader(d, 16, 7).read(np.arange(3))
    assert [(s.tolist(), t.tolist()) for s, t in read] == \
        [(s.tolist(), t.tolist()) for s, t in PairReader(d, 16, 7, shuffle=False).read(ids[:3])]


def test_the_unigram_reference_counts_the_targets_only(data):
    d = TokenData(data, "train")
    counts = Counter()
    for source_end, end in d.ends.tolist():
        counts.update(d.tokens[source_end:end].tolist())
    p = np.array(list(counts.values())) / sum(counts.values())
    assert abs(unigram_entropy(data) - float(-(p * np.log(p)).sum())) < 1e-9


def test_prepare_data_takes_pairs_from_the_command_line(rows, tmp_path, capsys):
    assert main(["prepare-data", "--input", rows[0], "--text-field", "text", "--target-field",
                 "target", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "pairs" in out and "source 'text', target 'target'" in out
    assert TokenData(tmp_path / "o").pairs == {"source": "text", "target": "target"}


def test_pairs_from_a_local_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"en": ["one", "two", "", "four"], "fr": ["un", "", "x", "quatre"]}
                               ).save_to_disk(str(tmp_path / "ds"))
    prepare_data([], str(tmp_path / "o"), text_field="en", target_field="fr",
                 hf_dataset=str(tmp_path / "ds"), val_fraction=0)
    d = TokenData(tmp_path / "o")
    read = PairReader(d, 16, 0, shuffle=False).read(np.arange(d.documents))
    assert [(bytes(s[:-1].tolist()), bytes(t[:-1].tolist())) for s, t in read] == \
        [(b"one", b"un"), (b"", b"x"), (b"four", b"quatre")]  # an empty target: skipped
    with pytest.raises(ConfigError, match="no column 'de' .* --target-field"):
        prepare_data([], str(tmp_path / "p"), text_field="en", target_field="de",
                     hf_dataset=str(tmp_path / "ds"))


def test_the_share_of_pairs_cut_is_counted(data):
    from meshplan.data.pairs import cut_shares

    d = TokenData(data, "train")
    starts = [0] + d.ends[:-1, 1].tolist()
    sizes = [(int(e0) - s, int(e1) - int(e0)) for s, (e0, e1) in zip(starts, d.ends.tolist())]
    n = len(sizes)
    assert cut_shares(d, 40, 30) == {"sources": sum(s > 40 for s, _ in sizes) / n,
                                     "targets": sum(t > 30 for _, t in sizes) / n}
    assert cut_shares(d, 40, joined_budget=41) == {"pairs": sum(s + t > 41 for s, t in sizes) / n}
    assert 0 < cut_shares(d, 40, 30)["sources"] < 1  # the fixture's lines: some cut, some not
