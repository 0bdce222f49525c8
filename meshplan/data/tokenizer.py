"""Tokenizers that turn text into the ids of a token directory.

Three kinds, named by `--tokenizer`:
- `bytes`: UTF-8 bytes 0..255, eod 256, vocab 257; needs nothing.
- `bpe:VOCAB`: a byte-level BPE trained offline on the inputs with the
  `tokenizers` library (an optional extra); `<|endoftext|>` is eod; saved
  as `tokenizer.json` in the token directory.
- a PATH: a local transformers tokenizer directory (never downloaded);
  eod is its eos token, else its sep token.

Invariants:
- `spec()` is JSON and holds what `load_tokenizer` needs to rebuild the
  same tokenizer from a token directory (a relative file for `bpe`).
- `decode` skips eod, so a document's ids decode to its text.
- `mask` and `pad` are the tokenizer's mask and padding tokens (a
  transformers tokenizer's own), or None: bytes and a BPE made here have none.
- A missing optional library or a bad argument is one ConfigError line.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from meshplan.data.tokens import read_index
from meshplan.errors import ConfigError

EOD_TEXT = "<|endoftext|>"
BPE_FILE = "tokenizer.json"
BYTES_VOCAB = 257
USAGE = "use `bytes`, `bpe:VOCAB` (e.g. `bpe:4096`) or a local tokenizer directory"


class TokenizerKind(enum.StrEnum):
    """The closed set of tokenizer kinds."""

    BYTES = "bytes"
    BPE = "bpe"
    PATH = "path"


@dataclass(frozen=True, slots=True)
class TokenizerArg:
    """A parsed `--tokenizer`: its kind, the BPE vocab or the directory."""

    kind: TokenizerKind
    vocab: int = 0
    path: str = ""


def parse_tokenizer_arg(text: str) -> TokenizerArg:
    """Parse and check `--tokenizer`: `bytes`, `bpe:VOCAB` or a tokenizer directory."""
    if text == "bytes":
        return TokenizerArg(TokenizerKind.BYTES)
    if text.startswith("bpe:"):
        vocab = text[4:]
        if not vocab.isdigit() or int(vocab) < BYTES_VOCAB:
            raise ConfigError(f"--tokenizer {text}: the BPE vocabulary must be a whole number "
                              f">= {BYTES_VOCAB} (256 bytes + eod), e.g. `--tokenizer bpe:4096`")
        return TokenizerArg(TokenizerKind.BPE, vocab=int(vocab))
    if not Path(text).is_dir():
        raise ConfigError(f"--tokenizer {text}: not a tokenizer directory; {USAGE}")
    return TokenizerArg(TokenizerKind.PATH, path=str(Path(text).resolve()))


class Tokenizer:
    """The interface: `vocab_size`, `eod`, `mask`, `pad`, `encode`, `decode`, `spec`."""

    vocab_size: int
    eod: int
    mask: int | None = None
    pad: int | None = None

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without eod."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; eod ids are skipped."""
        raise NotImplementedError

    def spec(self) -> dict:
        """A JSON description that `load_tokenizer` rebuilds this from."""
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes; eod 256."""

    vocab_size, eod = BYTES_VOCAB, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def spec(self) -> dict:
        return {"kind": TokenizerKind.BYTES.value}


def _tokenizers_lib():
    try:
        import tokenizers  # optional
    except ImportError:
        raise ConfigError("`--tokenizer bpe:...` needs the tokenizers library: "
                          "pip install tokenizers") from None
    return tokenizers


class BPETokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (byte-level BPE) with `<|endoftext|>` as eod."""

    def __init__(self, tok):
        self._tok = tok
        eod = tok.token_to_id(EOD_TEXT)
        assert eod is not None, "a BPE made here always has <|endoftext|>"
        self.eod, self.vocab_size = eod, tok.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab: int) -> BPETokenizer:
        """Train a byte-level BPE of at most `vocab` ids on `texts` (offline)."""
        lib = _tokenizers_lib()
        tok = lib.Tokenizer(lib.models.BPE())
        tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = lib.decoders.ByteLevel()
        trainer = lib.trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=[EOD_TEXT], show_progress=False,
            initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        """Read a BPE saved by `save`."""
        lib = _tokenizers_lib()
        try:
            return cls(lib.Tokenizer.from_file(str(path)))
        except Exception as e:  # the library raises bare Exceptions on bad files
            raise ConfigError(f"{path} is not a readable tokenizer file ({e}); "
                              "run `meshplan prepare-data` again") from None

    def save(self, path: Path) -> None:
        """Write the library's own tokenizer.json."""
        self._tok.save(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eod])

    def spec(self) -> dict:
        return {"kind": TokenizerKind.BPE.value, "vocab_size": self.vocab_size,
                "file": BPE_FILE}


class HFTokenizer(Tokenizer):
    """A local transformers tokenizer directory."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer  # optional
        except ImportError:
            raise ConfigError(f"--tokenizer {path} needs the transformers library: "
                              "pip install transformers") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokenizer {path}: no tokenizer loads from it "
                              f"({str(e).splitlines()[0]}); {USAGE}") from None
        eod = self._tok.eos_token_id
        eod = self._tok.sep_token_id if eod is None else eod
        if eod is None:
            raise ConfigError(f"--tokenizer {path} has neither an eos nor a sep token to end "
                              "documents with; add one to its tokenizer config")
        self.path, self.eod, self.vocab_size = path, int(eod), len(self._tok)
        self.mask, self.pad = self._tok.mask_token_id, self._tok.pad_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids if int(i) != self.eod]))

    def spec(self) -> dict:
        return {"kind": TokenizerKind.PATH.value, "path": self.path}


def make_tokenizer(arg: TokenizerArg, texts: Iterable[str]) -> Tokenizer:
    """The tokenizer for `arg`; a BPE is trained on `texts` (read only then)."""
    if arg.kind is TokenizerKind.BYTES:
        return ByteTokenizer()
    if arg.kind is TokenizerKind.BPE:
        return BPETokenizer.train(texts, arg.vocab)
    return HFTokenizer(arg.path)


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    """Rebuild the tokenizer a token directory was prepared with."""
    spec = read_index(data_dir).get("tokenizer") or {}
    kind = spec.get("kind")
    if kind == TokenizerKind.BYTES:
        return ByteTokenizer()
    if kind == TokenizerKind.BPE:
        return BPETokenizer.load(Path(data_dir) / spec.get("file", BPE_FILE))
    if kind == TokenizerKind.PATH:
        return HFTokenizer(spec["path"])
    raise ConfigError(f"{data_dir}: unknown tokenizer {spec!r} in its index; "
                      "run `meshplan prepare-data` again")


def special_token(data_dir: str, kind: str) -> int | None:
    """The `kind` ("mask" or "pad") token of the tokenizer a token directory
    was prepared with: a transformers tokenizer's own, else None."""
    return getattr(_specials(data_dir), kind)


@lru_cache(maxsize=8)
def _specials(data_dir: str) -> Tokenizer:
    """The tokenizer whose special tokens `special_token` reads: loaded once
    per directory (sizing and the feed both ask), a bare one for kinds
    that have none."""
    spec = read_index(data_dir).get("tokenizer") or {}
    return HFTokenizer(spec["path"]) if spec.get("kind") == TokenizerKind.PATH else Tokenizer()
