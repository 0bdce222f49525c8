"""A zoo or transformers language model trained on a prepared token
directory: the model sized from the data, its train and eval Jobs, and what
the run leaves behind (the weights file, a sample).

Invariants:
- The model's vocabulary is the data's (and one mask token more, for a
  masked or denoising model whose tokenizer has none): a `--vocab` that
  differs is one line (exit 2), as is a sequence longer than the data allows.
- A model feeds by its task (`layout_of`): next tokens for a causal LM,
  BERT's masking for a masked LM, masked inputs and the whole sample as
  labels for an encoder-decoder (`data/masking.py`).
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

from meshplan.data.feed import FeedReader, Layout, TokenFeed
from meshplan.data.tokenizer import load_tokenizer, mask_token
from meshplan.data.tokens import TokenData
from meshplan.driver.capture_check import checked_capture
from meshplan.driver.plan import capture_zoo, plan_model
from meshplan.driver.weights_out import OutTensor, write_safetensors
from meshplan.errors import ConfigError
from meshplan.ir.fileio import write_torch
from meshplan.models import build_model, model_config
from meshplan.models.generate import generate
from meshplan.models.hf import CAUSAL, MASKED, PREFIX, SEQ2SEQ, HFLoss, task_of
from meshplan.passes.plan import PASSES, Compilation, plan_forward

_ZOO_LAYOUTS = {"gpt": Layout.NEXT_TOKEN, "moe": Layout.NEXT_TOKEN, "bert": Layout.MASKED}
_TASK_LAYOUTS = {CAUSAL: Layout.SHIFTED_BY_MODEL, MASKED: Layout.MASKED,
                 SEQ2SEQ: Layout.DENOISE}
MASKING = (Layout.MASKED, Layout.DENOISE)


@dataclass(frozen=True)
class LanguageModel:
    """A model ready to train on token data: module, both Jobs."""

    seq_len: int
    module: torch.nn.Module
    job: object
    eval_job: object
    layout: str
    mask_id: int = -1  # the id a masking layout writes (`mask_id`)


def sized_config(model: str, size: str, data_dir: str, overrides: dict):
    """`model`'s config with the data's vocabulary, and one more id, the mask
    token, for a masked or denoising model whose tokenizer has none; its
    sequence checked against the data (one line for each mismatch)."""
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
        if layout_of(model, cfg) in MASKING and mask_token(data_dir) is None:
            raise ConfigError(f"the model in {cfg.source} predicts masked tokens, and the "
                              f"tokenizer {data_dir} was prepared with has no mask token; "
                              "prepare the data with the model's own tokenizer (--tokenizer "
                              "PATH)")
    else:
        cfg = model_config(model, size, **(overrides | {"vocab": data.vocab_size}))
        extra = layout_of(model, cfg) in MASKING and mask_token(data_dir) is None
        _check_vocab(overrides.get("vocab"), data.vocab_size, data_dir, extra)
        if extra:
            cfg = model_config(model, size, **(overrides | {"vocab": data.vocab_size + 1}))
    data.check_seq_len(cfg.seq_len)
    return cfg


def _check_vocab(given: int | None, data_vocab: int, data_dir: str, mask: bool) -> None:
    """A `--vocab` other than the data's (and its mask token's): one line."""
    if given is not None and given != data_vocab + mask:
        raise ConfigError(f"--vocab {given} differs from the vocabulary of {data_dir} "
                          f"({data_vocab} tokens, its tokenizer's"
                          f"{', and a mask token' if mask else ''}); leave --vocab out to "
                          "take the data's, or prepare the data with a matching tokenizer")


def layout_of(model: str, cfg) -> Layout:
    """How token samples feed `model` (`data/feed.Layout`): by its task."""
    return _ZOO_LAYOUTS.get(model) or _TASK_LAYOUTS[task_of(cfg)]


def mask_id(data_dir: str, layout: Layout) -> int:
    """The id a masking layout writes: the tokenizer's mask token, else the
    one id past the data's vocabulary (`sized_config` embeds it); -1 for
    the others."""
    if layout not in MASKING:
        return -1
    token = mask_token(data_dir)
    return TokenData(data_dir, "train").vocab_size if token is None else token


def language_model(model: str, size: str, data_dir: str, mesh, strategy, optimizer,
                   seed: int, overrides: dict) -> LanguageModel:
    """The model, sized from the data, with its train and eval Jobs."""
    cfg = sized_config(model, size, data_dir, overrides)
    layout = layout_of(model, cfg)
    sized = overrides | {"vocab": cfg.vocab}
    job = plan_model(model, size, mesh, strategy, optimizer, None, **sized).job
    s = job.strategy
    eval_job = plan_forward(capture_zoo(cfg, s.micro_batch_size * s.dp, s.precision), mesh, s)
    torch.manual_seed(seed)
    return LanguageModel(cfg.seq_len, build_model(cfg), job, eval_job, layout,
                         mask_id(data_dir, layout))


def user_model(path: str, data_dir: str, seq_len: int, mesh, strategy, optimizer,
               seed: int) -> LanguageModel:
    """A user's `nn.Module` from `PKG.MODULE:FACTORY`: the factory is called
    with the keyword arguments it takes of `vocab_size` (the data's) and
    `seq_len`, and returns a module whose `forward(inputs, targets)` returns
    the loss of predicting `targets`, the next tokens. It is captured on the
    data's first micro-batch (and self-checked), then planned for training
    and for evaluation."""

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
    reader = FeedReader(TokenFeed(data_dir, "train", seq_len, seed), strategy.global_batch_size,
                        strategy.num_microbatches)
    x, y = reader.microbatches(0)[0]
    graph = checked_capture(module, (x, y), precision=strategy.precision)
    job = PASSES.run(Compilation(graph, mesh, strategy, optimizer)).job
    eval_job = plan_forward(graph, mesh, job.strategy)
    return LanguageModel(seq_len, module, job, eval_job, Layout.NEXT_TOKEN)


def unigram_entropy(data_dir: str) -> float:
    """The entropy (nats) of the training split's token frequencies: the
    loss of a model that knows only how often each token occurs."""
    data = TokenData(data_dir, "train")
    counts = np.zeros(data.vocab_size, dtype=np.int64)
    chunk = 1 << 24
    for i in range(0, len(data.tokens), chunk):
        counts += np.bincount(np.asarray(data.tokens[i:i + chunk]),
                              minlength=data.vocab_size)[:data.vocab_size]
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
    text: list[str] = []
    run: list[int] = []
    for t, g, c in zip(original.tolist(), guess.tolist(), chosen.tolist()):
        if c:
            text += [tok.decode(run), f"[{tok.decode([g])}]"]
            run = []
        else:
            run.append(t)
    text.append(tok.decode(run))
    return {"text": "".join(text), "right": int((guess == original)[chosen].sum()),
            "masked": int(chosen.sum())}


def stdlib_files() -> list[str]:
    """The Python standard library's own source files (not site-packages,
    not its tests): real text every machine with Python has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "turtledemo"}
    return sorted(str(p) for p in root.rglob("*.py") if not skip & set(p.parts))
