"""Sampling from a trained language model, eagerly, to show a person what it
learned.

Invariant: plain PyTorch on the module's own weights (no plan), under
`no_grad`, deterministic in `seed`; the context is the last `seq_len`
tokens, as the model was trained.
"""

from __future__ import annotations

import torch
from torch import nn


def next_logits(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits (B, T, vocab) of a zoo GPT (`logits`) or a transformers
    causal LM wrapped in `HFLoss` (its `model`)."""
    if hasattr(module, "logits"):
        return module.logits(ids)
    return module.model(input_ids=ids).logits  # type: ignore[operator]


def generate(module: nn.Module, prompt: list[int], new_tokens: int, seq_len: int,
             top_k: int = 0, seed: int = 0) -> list[int]:
    """`prompt` followed by `new_tokens` sampled tokens: greedy with
    `top_k` 0, else from the `top_k` most likely at each step."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for _ in range(new_tokens):
                context = torch.tensor([ids[-seq_len:]], dtype=torch.long)
                logits = next_logits(module, context)[0, -1].float()
                if top_k:
                    values, index = logits.topk(min(top_k, logits.numel()))
                    pick = torch.multinomial(values.softmax(-1), 1, generator=gen)
                    ids.append(int(index[pick]))
                else:
                    ids.append(int(logits.argmax()))
    finally:
        module.train(was_training)
    return ids


def translate(module: nn.Module, source: torch.Tensor, new_tokens: int, stop: int) -> list[int]:
    """An encoder-decoder's greedy answer to `source` (1, T) (a transformers
    model wrapped in `HFLoss`, which masks the source's padding): up to
    `new_tokens` tokens, ending before `stop`."""
    model = module.model  # type: ignore[union-attr]
    start = model.config.decoder_start_token_id
    start = model.config.pad_token_id if start is None else start
    out: list[int] = []
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            mask = module.attention_mask(source)  # type: ignore[operator]
            encoded = model.get_encoder()(input_ids=source, attention_mask=mask)
            for _ in range(new_tokens):
                decoder_ids = torch.tensor([[start, *out]], dtype=torch.long)
                logits = model(encoder_outputs=encoded, attention_mask=mask,
                               decoder_input_ids=decoder_ids).logits
                token = int(logits[0, -1].argmax())
                if token == stop:
                    break
                out.append(token)
    finally:
        module.train(was_training)
    return out
