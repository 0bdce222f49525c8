"""`meshplan train` of masked LMs, encoder-decoders and the zoo's MoE on
token data, against an eager PyTorch loop reading the same feed: every
step's loss, each evaluation and every trained parameter within 1e-5.

The zoo's BERT at dp2 (BERT's masking: each rank masks its own rows), a
transformers BERT at pp2 and T5 (denoising) at dp2. The byte tokenizer has
no mask token, so each model embeds one more id, 257, the data's 257 ids
being the bytes and eod.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshplan.data.feed import FeedReader, Layout, TokenFeed
from meshplan.driver.train_model import sized_config
from meshplan.models import build_model
from tests.token_data import prepare, stdlib_sources
from tests.train_compare import train_and_compare


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("masked") / "data", stdlib_sources(4)[1:],
                   "--val-fraction", "0.3")


@pytest.mark.slow
def test_zoo_bert_at_dp2_trains_as_eager(data, tmp_path, capsys):
    s = train_and_compare(data, tmp_path / "run", ["--model", "bert", "--devices-per-node", "2",
                                                   "--dp", "2", "--tp", "1", "--pp", "1"],
                          Layout.MASKED, 2, capsys)
    fill = s["fill"]  # the summary's sample: the model's guesses at masked tokens
    assert 1 <= fill["masked"] and 0 <= fill["right"] <= fill["masked"]
    assert fill["text"].count("[") >= fill["masked"]


@pytest.mark.slow
def test_zoo_moe_at_ep2_trains_as_eager(data, tmp_path, capsys):
    """The zoo's mixture of experts, a causal LM, with its experts split."""
    train_and_compare(data, tmp_path / "run", ["--model", "moe", "--devices-per-node", "2",
                                               "--dp", "2", "--ep", "2", "--tp", "1", "--pp",
                                               "1"], Layout.NEXT_TOKEN, 2, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("model, layout, dp, flags, stray", [
    ("bert", Layout.MASKED, 1, ["--devices-per-node", "2", "--tp", "1", "--pp", "2"], 0),
    # T5: one element of a decoder key's weight ends 1.06e-5 off, at 1 rank
    # too: its step-1 gradient cancels to -5.6e-9 from micro-batch terms of
    # 1e-4, and AdamW's g / (|g| + eps) turns that sum's rounding into its
    # step (the judge's `Flips`, docs/concepts/verify.md)
    ("t5", Layout.DENOISE, 2, ["--devices-per-node", "2", "--dp", "2", "--tp", "1", "--pp",
                               "1"], 1),
])
def test_transformers_models_train_as_eager(data, tmp_path, capsys, model, layout, dp, flags,
                                            stray):
    pytest.importorskip("transformers")
    train_and_compare(data, tmp_path / "run", ["--hf", model, *flags], layout, dp, capsys,
                      stray)


def test_a_tokenizers_own_mask_token_is_the_one_written(data, tmp_path):
    """Data prepared with a transformers tokenizer that has a mask token:
    the model's vocabulary is the tokenizer's, and that token is masked in."""
    transformers = pytest.importorskip("transformers")
    from meshplan.data.tokenizer import BPETokenizer
    from meshplan.driver.train_model import written_id

    sources = stdlib_sources(4)[1:]
    texts = [Path(f).read_text() for f in sources]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=BPETokenizer.train(iter(texts), 300)._tok, eos_token="<|endoftext|>",
        mask_token="<mask>")
    fast.save_pretrained(tmp_path / "tok")
    d = prepare(tmp_path / "data", sources, "--tokenizer", str(tmp_path / "tok"),
                "--val-fraction", "0.3")
    assert sized_config("hf:bert", "tiny", d, {}).vocab == len(fast)
    assert written_id(d, Layout.MASKED) == fast.mask_token_id
    x, y = FeedReader(TokenFeed(d, "train", 16, 0, Layout.MASKED, mask_id=fast.mask_token_id),
                      8, 1).batch(0)
    written = x == fast.mask_token_id
    assert written.any() and (y[written] >= 0).all()  # written only where labelled
    # the byte data's model embeds its own mask id, one past the data's
    assert sized_config("hf:bert", "tiny", data, {}).vocab == 258
    assert written_id(data, Layout.MASKED) == 257 and written_id(data, Layout.NEXT_TOKEN) == -1


def test_a_saved_masked_lm_needs_data_with_its_mask_token(data, tmp_path):
    """--init-from a saved BERT with byte data (no mask token): one line."""
    pytest.importorskip("transformers")
    from meshplan.errors import ConfigError
    from meshplan.models import model_config

    build_model(model_config("hf:bert", "tiny", vocab=300)).model.save_pretrained(
        tmp_path / "bert")
    with pytest.raises(ConfigError, match="has no mask token; prepare the data with the "
                                          "model's own tokenizer"):
        sized_config("hf:", "tiny", data, {"source": str(tmp_path / "bert")})


def test_the_vocabulary_a_masked_model_needs_is_named(data):
    from meshplan.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--vocab 257 differs .* \(257 tokens, its "
                                          r"tokenizer's, and a mask token\)"):
        sized_config("bert", "tiny", data, {"vocab": 257})
    assert sized_config("bert", "tiny", data, {"vocab": 258}).vocab == 258
    with pytest.raises(ConfigError, match=r"--vocab 258 differs .* \(257 tokens, its "
                                          r"tokenizer's\); leave"):
        sized_config("gpt", "tiny", data, {"vocab": 258})  # no mask token for a causal LM


def test_a_word_piece_guess_joins_its_word(tmp_path):
    """The fill sample decodes the sample whole, each token's piece of it:
    WordPiece's `##ing` shows as `ing`, and a guess keeps its word's space."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from meshplan.driver.train_model import fill_sample

    vocab = {"[PAD]": 0, "[UNK]": 1, "[SEP]": 2, "[MASK]": 3, "the": 4, "walk": 5, "##ing": 6,
             "dog": 7, "is": 8}
    wp = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wp.pre_tokenizer, wp.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=wp, sep_token="[SEP]", mask_token="[MASK]", unk_token="[UNK]",
        pad_token="[PAD]").save_pretrained(tmp_path / "tok")
    for name in ("a", "b"):  # a document each split
        (tmp_path / f"{name}.txt").write_text("the dog is walking " * 40)
    d = prepare(tmp_path / "data", [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
                "--tokenizer", str(tmp_path / "tok"), "--val-fraction", "0.5")

    class Guesses(torch.nn.Module):  # guesses ##ing everywhere
        def logits(self, x):
            return torch.nn.functional.one_hot(torch.full_like(x, 6), 9).float()

    feed = TokenFeed(d, "train", 16, 0, Layout.MASKED, mask_id=3, mask_rate=0.5)
    fill = fill_sample(Guesses(), feed)
    assert "##" not in fill["text"] and fill["text"].count("[ing]") == fill["masked"] >= 1
    assert " [ing]" in fill["text"] or fill["text"].startswith("[ing]")
