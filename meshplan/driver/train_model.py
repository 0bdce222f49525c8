"""A zoo or transformers language model trained on a prepared token
directory: the model sized from the data, its train and eval Jobs, and what
the run leaves behind (the weights file, a sample).

Invariants:
- The model's vocabulary is the data's, and one id more where its layout
  writes an id that is not text (a mask, a source's padding) and the
  tokenizer has none of its own: a `--vocab` that differs is one line
  (exit 2), as is a sequence longer than the data allows.
- A model feeds by its task and the data (`layout_of`): on text, next
  tokens for a causal LM, BERT's masking for a masked LM, masked inputs
  and the whole sample as labels for an encoder-decoder
  (`data/masking.py`); on pairs, the source in and the target labelled for
  an encoder-decoder, source then target with the target labelled for a
  causal LM (`data/pairs.py`); a masked LM takes text only.
- The weights the ranks start from are the module built here (seeded), the
  very weights an eager reference would start from.
- The eval Job is the forward graph planned with the train Job's strategy
  (after `resolve_derived`), so both lay every parameter out alike.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from meshplan.data.feed import PACKED, FeedReader, Layout, TokenFeed
from meshplan.data.pairs import PackedPairReader, cut_shares
from meshplan.data.tokenizer import load_tokenizer, special_token
from meshplan.data.tokens import TokenData, read_index
from meshplan.driver.capture_check import checked_capture
from meshplan.driver.plan import capture_zoo, plan_model
from meshplan.driver.weights_out import OutTensor, write_safetensors
from meshplan.errors import ConfigError
from meshplan.ir.fileio import write_torch
from meshplan.models import build_model, model_config
from meshplan.models.generate import generate, translate
from meshplan.models.hf import CAUSAL, MASKED, PREFIX, SEQ2SEQ, HFLoss, encoder_decoder, task_of
from meshplan.passes.plan import PASSES, Compilation, plan_forward

_ZOO_LAYOUTS = {"gpt": Layout.NEXT_TOKEN, "moe": Layout.NEXT_TOKEN, "bert": Layout.MASKED}
_TASK_LAYOUTS = {CAUSAL: Layout.SHIFTED_BY_MODEL, MASKED: Layout.MASKED,
                 SEQ2SEQ: Layout.DENOISE}
MASKING = (Layout.MASKED, Layout.DENOISE)
_ON_PAIRS = {Layout.NEXT_TOKEN: Layout.JOINED, Layout.SHIFTED_BY_MODEL: Layout.JOINED_SHIFTED,
             Layout.DENOISE: Layout.SOURCE_TARGET}  # a text layout's task, on paired data
_WRITES = {Layout.MASKED: "mask", Layout.DENOISE: "mask", Layout.SOURCE_TARGET: "pad"}


@dataclass(frozen=True)
class LanguageModel:
    """A model ready to train on token data: module, both Jobs."""

    seq_len: int
    module: torch.nn.Module
    job: object
    eval_job: object
    layout: str
    mask_id: int = -1  # the id a masking layout writes (`written_id`)
    pad_id: int = -1  # the id SOURCE_TARGET pads sources with (`written_id`)
    target_len: int = 0  # an encoder-decoder's labels' length (`ModelConfig`); 0: seq_len


def sized_config(model: str, size: str, data_dir: str, overrides: dict):
    """`model`'s config with the data's vocabulary, and one more id (a mask,
    a pad) where its layout writes one the tokenizer has not; on paired data
    an encoder-decoder's `pad_id`; its sequence checked against the data
    (one line for each mismatch)."""
    if model not in _ZOO_LAYOUTS and not model.startswith(PREFIX):
        raise ConfigError(f"meshplan train reads token data into language models (--model "
                          f"gpt or bert, or an --hf type such as gpt2, bert or t5); {model} is "
                          "not one. Train it on synthetic data with `meshplan run`")
    data = TokenData(data_dir, "train")
    if overrides.get("source"):  # a saved model's vocabulary is its own: the data's fits in it
        _check_vocab(overrides.get("vocab"), data.vocab_size, data_dir, False)
        cfg = model_config(model, size, **overrides)
        if data.vocab_size > cfg.vocab:
            raise ConfigError(f"{data_dir} has {data.vocab_size} token ids but the model in "
                              f"{cfg.source} embeds {cfg.vocab}; prepare the data with the "
                              "model's own tokenizer (--tokenizer PATH)")
        layout = layout_of(model, cfg, data_dir)
        # a model meshplan trained on this data embeds the token the tokenizer lacks as
        # one id past its vocabulary (`written_id`): a vocabulary one larger is that
        if layout in _WRITES and special_token(data_dir, _WRITES[layout]) is None and \
                cfg.vocab != data.vocab_size + 1:
            does = "predicts masked tokens" if layout in MASKING else "reads padded sources"
            raise ConfigError(f"the model in {cfg.source} {does}, and the tokenizer "
                              f"{data_dir} was prepared with has no {_WRITES[layout]} token; "
                              "prepare the data with the model's own tokenizer (--tokenizer "
                              "PATH)")
    else:
        cfg = model_config(model, size, **(overrides | {"vocab": data.vocab_size}))
        layout = layout_of(model, cfg, data_dir)
        extra = _WRITES[layout] if layout in _WRITES and \
            special_token(data_dir, _WRITES[layout]) is None else ""
        _check_vocab(overrides.get("vocab"), data.vocab_size, data_dir, extra)
        if extra:
            cfg = model_config(model, size, **(overrides | {"vocab": data.vocab_size + 1}))
    if layout is Layout.SOURCE_TARGET:
        cfg = model_config(model, size, **(overrides | {"vocab": cfg.vocab,
                                                        "pad_id": written_id(data_dir, layout)}))
    elif cfg.target_len and cfg.target_len != cfg.seq_len:
        raise ConfigError(f"--target-len {cfg.target_len} is the length of an encoder-decoder's "
                          f"targets on paired data; {data_dir} holds text, whose denoising "
                          "reconstructs the whole sample: leave --target-len out, or prepare "
                          "pairs (--target-field)")
    data.check_seq_len(cfg.seq_len)
    return cfg


def _check_vocab(given: int | None, data_vocab: int, data_dir: str, extra: str) -> None:
    """A `--vocab` other than the data's (and its `extra` token's): one line."""
    if given is not None and given != data_vocab + bool(extra):
        raise ConfigError(f"--vocab {given} differs from the vocabulary of {data_dir} "
                          f"({data_vocab} tokens, its tokenizer's"
                          f"{f', and a {extra} token' if extra else ''}); leave --vocab out "
                          "to take the data's, or prepare the data with a matching tokenizer")


def layout_of(model: str, cfg, data_dir: str | None = None) -> Layout:
    """How the samples of `data_dir` feed `model` (`data/feed.Layout`): by
    its task, and whether the data is text or pairs (a masked LM on pairs:
    one line; a sequence-to-sequence type that decodes one stream, a speech
    model's, reads a pair as a causal LM does)."""
    text = _ZOO_LAYOUTS.get(model) or _TASK_LAYOUTS[task_of(cfg)]
    if data_dir is None or "pairs" not in read_index(data_dir):
        if data_dir is not None and getattr(cfg, "packed", False):
            raise ConfigError(f"--pack packs pairs into rows; {data_dir} holds text, whose rows "
                              "are full windows already: leave --pack out, or prepare pairs "
                              "(--target-field)")
        return text
    if text is Layout.DENOISE and not encoder_decoder(cfg):
        return Layout.JOINED_SHIFTED
    if text not in _ON_PAIRS:
        raise ConfigError(f"{data_dir} holds pairs (source, target), and {model} is a masked "
                          "LM, which learns from text; prepare the data without "
                          "--target-field, or train a causal LM or an encoder-decoder "
                          "(e.g. --hf t5) on the pairs")
    if getattr(cfg, "packed", False):
        return Layout.PACKED if text is Layout.NEXT_TOKEN else Layout.PACKED_SHIFTED
    return _ON_PAIRS[text]


def written_id(data_dir: str, layout: Layout) -> int:
    """The id `layout` writes that is not text (a masking layout's mask, a
    source's padding): the tokenizer's own token, else the one id past the
    data's vocabulary (`sized_config` embeds it); -1 for the others."""
    if layout not in _WRITES:
        return -1
    token = special_token(data_dir, _WRITES[layout])
    return TokenData(data_dir, "train").vocab_size if token is None else token


def language_model(model: str, size: str, data_dir: str, mesh, strategy, optimizer,
                   seed: int, overrides: dict) -> LanguageModel:
    """The model, sized from the data, with its train and eval Jobs."""
    cfg = sized_config(model, size, data_dir, overrides)
    layout = layout_of(model, cfg, data_dir)
    sized = overrides | {"vocab": cfg.vocab} | ({"pad_id": cfg.pad_id} if cfg.pad_id >= 0 else {})
    job = plan_model(model, size, mesh, strategy, optimizer, None, **sized).job
    s = job.strategy
    eval_job = plan_forward(capture_zoo(cfg, s.micro_batch_size * s.dp, s.precision), mesh, s)
    torch.manual_seed(seed)
    written = written_id(data_dir, layout)
    module = build_model(cfg)
    if layout is Layout.PACKED_SHIFTED:  # a transformers type (the zoo's GPT: `pair_mask`)
        _check_packing(module, model)
    return LanguageModel(cfg.seq_len, module, job, eval_job, layout,
                         written if layout in MASKING else -1,
                         written if layout is Layout.SOURCE_TARGET else -1, cfg.target_len)


def _check_packing(module: torch.nn.Module, model: str) -> None:
    """One line unless `module` keeps each pair of a packed row to itself:
    the logits of a pair packed after another are its logits alone."""
    hf = module.model  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(0)
    vocab = hf.get_input_embeddings().num_embeddings
    first, second = (torch.randint(1, vocab, (1, n), generator=gen) for n in (5, 6))
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            row = hf(input_ids=torch.cat([first, second], 1), position_ids=torch.cat(
                [torch.arange(5), torch.arange(6)])[None]).logits[0, 5:]
            alone = hf(input_ids=second, position_ids=torch.arange(6)[None]).logits[0]
    finally:
        module.train(was)
    if not torch.allclose(row, alone, rtol=1e-4, atol=1e-4):
        raise ConfigError(f"--pack: {model} attends across the pairs of a row (its attention "
                          "does not follow position ids that restart at each pair); leave "
                          "--pack out")


def user_model(path: str, data_dir: str, seq_len: int, mesh, strategy, optimizer,
               seed: int) -> LanguageModel:
    """A user's `nn.Module` from `PKG.MODULE:FACTORY`: the factory is called
    with the keyword arguments it takes of `vocab_size` (the data's) and
    `seq_len`, and returns a module whose `forward(inputs, targets)` returns
    the loss of predicting `targets`, the next tokens (on pairs, only the
    target's: the others are `IGNORE_INDEX`, -100, which cross entropy skips
    by default). It is captured on the data's first micro-batch (and
    self-checked), then planned for training and for evaluation."""

    modname, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(modname), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"--module {path}: cannot import it ({err}); give PKG.MODULE:FACTORY "
                          "of a function on the Python path that returns an nn.Module"
                          ) from None
    data = TokenData(data_dir, "train")
    data.check_seq_len(seq_len)
    given = {"vocab_size": data.vocab_size, "seq_len": seq_len}
    wants = inspect.signature(factory).parameters
    torch.manual_seed(seed)
    module = factory(**{k: v for k, v in given.items() if k in wants})
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"--module {path} returned {type(module).__name__}, not an nn.Module")
    layout = Layout.JOINED if data.pairs else Layout.NEXT_TOKEN
    reader = FeedReader(TokenFeed(data_dir, "train", seq_len, seed, layout),
                        strategy.global_batch_size, strategy.num_microbatches)
    x, y = reader.microbatches(0)[0]
    graph = checked_capture(module, (x, y), precision=strategy.precision)
    job = PASSES.run(Compilation(graph, mesh, strategy, optimizer)).job
    eval_job = plan_forward(graph, mesh, job.strategy)
    return LanguageModel(seq_len, module, job, eval_job, layout)


def unigram_entropy(data_dir: str) -> float:
    """The entropy (nats) of the training split's token frequencies (of
    paired data, its targets', the tokens a model learns): the loss of a
    model that knows only how often each token occurs."""
    data = TokenData(data_dir, "train")
    counts = np.zeros(data.vocab_size, dtype=np.int64)
    chunk = 1 << 24
    for i in range(0, len(data.tokens), chunk):
        tokens = np.asarray(data.tokens[i:i + chunk])
        if data.pairs is not None:  # position p is in pair k, a target from ends[k, 0] on
            at = np.arange(i, i + len(tokens), dtype=np.uint64)
            k = np.searchsorted(data.ends[:, 1], at, side="right")
            tokens = tokens[at >= data.ends[k, 0]]
        counts += np.bincount(tokens, minlength=data.vocab_size)[:data.vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def write_weights(weights: dict[str, torch.Tensor], out: str) -> Path:
    """The trained weights as one consolidated file, written atomically and
    the same bytes for the same weights: `model.safetensors` (each tensor
    once, by name; a tied tensor's other names in its metadata) when
    safetensors is installed to read it, else torch's `model.pt` (every name)."""

    if importlib.util.find_spec("safetensors") is None:
        path = Path(out) / "model.pt"
        write_torch(path, dict(weights))
        return path
    unique: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in weights.items():
        first = unique.setdefault(id(t), name)
        if first != name:
            aliases[name] = first
    tensors = [OutTensor((n,), n, tuple(weights[n].shape), weights[n].dtype)
               for n in sorted(unique.values())]
    path = Path(out) / "model.safetensors"
    write_safetensors(path, tensors, weights.__getitem__,
                      {"aliases": json.dumps(aliases, sort_keys=True)})
    return path


def sample_text(module, data_dir: str, seq_len: int, new_tokens: int = 120,
                seed: int = 0) -> tuple[str, str]:
    """(prompt, continuation): the start of the validation split followed by
    what the model writes after it (top-k 5 sampling, eager PyTorch)."""
    tok = load_tokenizer(data_dir)
    val = TokenData(data_dir, "validation")
    n = min(len(val.tokens), max(8, seq_len // 2))
    prompt = [int(x) for x in val.tokens[:n] if int(x) != tok.eod]
    ids = generate(module, prompt, new_tokens, seq_len, top_k=5, seed=seed)
    return tok.decode(prompt), tok.decode([i for i in ids[len(prompt):] if i != tok.eod])


def fill_sample(module, feed: TokenFeed) -> dict:
    """A masked or denoising model's guesses (eager PyTorch, greedy): the
    validation split's first sample masked as the run masks it, with the
    most likely token at each masked position. {"text": the sample with
    each guess in [brackets], "right": guesses equal to the original,
    "masked": positions}."""
    tok = load_tokenizer(feed.data_dir)
    reader = FeedReader(replace(feed, split="validation", shuffle=False), 1, 1)
    (x, labels), = reader.microbatches(0)
    whole = Layout(feed.layout) is Layout.DENOISE
    original = labels if whole else torch.where(labels < 0, x, labels)
    chosen = x == feed.mask_id if whole else labels >= 0
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            if isinstance(module, HFLoss):
                logits = module.model(input_ids=x, labels=labels if whole else None).logits
            else:
                logits = module.logits(x)
    finally:
        module.train(was_training)
    guess, original, chosen = logits.argmax(-1)[0], original[0], chosen[0]
    shown = torch.where(chosen, guess, original).tolist()
    text: list[str] = []
    done = ""
    for i, c in enumerate(chosen.tolist()):  # each token's piece of the decoded whole, so a
        upto = tok.decode(shown[:i + 1])  # word piece (WordPiece's ##ing) joins its word
        piece, done = upto[len(done):], upto
        piece = piece.removeprefix("##") if i == 0 else piece  # a sample can start mid-word
        word = piece.lstrip() or _unwritten(shown[i], tok.eod, feed.mask_id) if c else ""
        text.append(f"{piece[:len(piece) - len(piece.lstrip())]}[{word}]" if c else piece)
    return {"text": "".join(text), "right": int((guess == original)[chosen].sum()),
            "masked": int(chosen.sum())}


def _unwritten(token: int, eod: int, mask: int) -> str:
    """What a guess the tokenizer decodes to nothing shows as."""
    return {eod: "<eod>", mask: "<mask>"}.get(token, f"<{token}>")


def pair_cuts(feed: TokenFeed) -> dict[str, float]:
    """The shares of the training pairs that `feed`'s rows cut (`pairs.cut_shares`)."""
    layout = Layout(feed.layout)
    budget = 0 if layout is Layout.SOURCE_TARGET else feed.seq_len + (layout is Layout.JOINED)
    return cut_shares(TokenData(feed.data_dir, "train"), feed.seq_len, feed.target_len, budget)


def pack_fill(feed: TokenFeed) -> dict[str, float]:
    """How full packing makes the training rows (its first epoch): pairs a
    row, and the share of positions that hold a pair's token, not padding."""
    reader = PackedPairReader(TokenData(feed.data_dir, "train"), feed.seq_len, feed.seed)
    rows = reader.rows_in_epoch(0)
    tokens = int(np.minimum(reader.lengths, feed.seq_len).sum())
    return {"pairs_per_row": len(reader.lengths) / rows, "filled": tokens / (rows * feed.seq_len)}


def answer_sample(module, feed: TokenFeed, new_tokens: int) -> dict:
    """A model trained on pairs answering the validation split's first
    source (eager PyTorch, greedy, up to `new_tokens` tokens or eod): an
    encoder-decoder from the source as trained, a causal LM after it (a
    packed one as a pair alone is laid out).
    {"source", "answer", "target"}: texts."""
    tok = load_tokenizer(feed.data_dir)
    if Layout(feed.layout) in PACKED:  # a pair alone
        feed = replace(feed, layout=Layout.JOINED_SHIFTED if Layout(feed.layout) is
                       Layout.PACKED_SHIFTED else Layout.JOINED)
    reader = FeedReader(replace(feed, split="validation", shuffle=False), 1, 1)
    (x, labels), = reader.microbatches(0)
    source, target = reader.reader.read([0])[0]  # type: ignore[union-attr]
    if Layout(feed.layout) is Layout.SOURCE_TARGET:
        longest = feed.target_len or feed.seq_len  # the decoder's positions
        answer = translate(module, x, min(new_tokens, longest), tok.eod)
    else:  # the prompt: the source as trained, up to the first labelled position
        first = int((labels[0] >= 0).nonzero()[0])  # JOINED labels the next token: one more
        prompt = x[0, :first + (Layout(feed.layout) is Layout.JOINED)].tolist()
        ids = generate(module, prompt, new_tokens, feed.seq_len)[len(prompt):]
        answer = ids[:ids.index(tok.eod)] if tok.eod in ids else ids
    return {"source": tok.decode(source.tolist()), "answer": tok.decode(answer),
            "target": tok.decode(target.tolist())}


def stdlib_files() -> list[str]:
    """The Python standard library's own source files (not site-packages,
    not its tests): real text every machine with Python has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "turtledemo"}
    return sorted(str(p) for p in root.rglob("*.py") if not skip & set(p.parts))
