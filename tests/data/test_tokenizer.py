"""Tokenizers: the bytes round trip, a BPE trained offline and rebuilt from
its spec, a local transformers directory, and `--tokenizer` checks."""

import glob
import sysconfig

import pytest

from meshplan.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    TokenizerArg,
    TokenizerKind,
    parse_tokenizer_arg,
)
from meshplan.errors import ConfigError

TEXT = "héllo, wörld — ∑ 🚀\n\tdef f(x): return x\n"


def stdlib_texts(count=20):
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:count]
    return [open(f, encoding="utf-8", errors="replace").read()[:4000] for f in files]


def test_bytes_round_trip_and_eod():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert max(ids) < 256 and tok.decode(ids) == TEXT
    assert tok.decode(ids + [256]) == TEXT and (tok.vocab_size, tok.eod) == (257, 256)
    assert tok.decode([0xC3]) == "\ufffd"


def test_a_bpe_trains_offline_and_round_trips(tmp_path):
    tok = BPETokenizer.train(iter(stdlib_texts()), 600)
    assert 300 < tok.vocab_size <= 600 and tok.decode(tok.encode(TEXT)) == TEXT
    assert len(tok.encode("def __init__(self):")) < len("def __init__(self):") / 2
    tok.save(tmp_path / "tokenizer.json")
    again = BPETokenizer.load(tmp_path / "tokenizer.json")
    assert again.encode(TEXT) == tok.encode(TEXT) and again.eod == tok.eod


def test_a_local_transformers_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    bpe = BPETokenizer.train(iter(stdlib_texts(5)), 400)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tok,
                                                eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "tok")
    arg = parse_tokenizer_arg(str(tmp_path / "tok"))
    assert arg.kind is TokenizerKind.PATH
    tok = HFTokenizer(arg.path)
    assert tok.eod == bpe.eod and tok.vocab_size == len(fast)
    assert tok.encode(TEXT) == bpe.encode(TEXT) and tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.spec() == {"kind": "path", "path": arg.path}


def test_parse_tokenizer_arg(tmp_path):
    assert parse_tokenizer_arg("bytes") == TokenizerArg(TokenizerKind.BYTES)
    assert parse_tokenizer_arg("bpe:4096") == TokenizerArg(TokenizerKind.BPE, vocab=4096)
    for bad in ("bpe:abc", "bpe:10", "bpe:"):
        with pytest.raises(ConfigError, match="e.g. `--tokenizer bpe:4096`"):
            parse_tokenizer_arg(bad)
    with pytest.raises(ConfigError, match="not a tokenizer directory"):
        parse_tokenizer_arg(str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="no tokenizer loads"):
        HFTokenizer(str(tmp_path))


def without(monkeypatch, library):
    """Make `import library` fail, as where it is not installed."""
    import builtins
    real = builtins.__import__

    def guarded(name, *args, **kwargs):
        if name.split(".")[0] == library:
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)


def test_a_missing_optional_library_is_one_line(monkeypatch, tmp_path):
    without(monkeypatch, "tokenizers")
    with pytest.raises(ConfigError, match="needs the tokenizers library: pip install tokenizers"):
        BPETokenizer.train(iter(["abc"]), 300)
    without(monkeypatch, "transformers")
    with pytest.raises(ConfigError, match="needs the transformers library: pip install"):
        HFTokenizer(str(tmp_path))
