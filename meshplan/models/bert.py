"""BERT encoder (post-LN, as in the original paper) with an MLM head.

Invariants:
- Module paths mirror GPT's where the layers match, so one set of tensor
  parallel rules covers both: `wte`, `wpe`, `ln_emb`, `blocks.{i}.{attn.qkv,
  attn.proj,ln1,mlp.fc1,mlp.fc2,ln2}`, then `head_dense`, `head_ln`, `head`.
- Attention is bidirectional (no mask) and uses GPT's head-major qkv layout.
- `head` is untied from `wte` (see gpt.py), so this model has about
  vocab * hidden more parameters than the published BERT.
- `forward(tokens, labels)` returns the mean MLM loss over positions whose
  label is not -100.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.models.gpt import MLP, Attention, init_weights

IGNORE_INDEX = -100
MASK_TOKEN = 0


class Block(nn.Module):
    """One post-LN encoder layer: ln1(x + attn(x)), then ln2(x + mlp(x))."""

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.attn = Attention(hidden, heads, dropout, causal=False)
        self.drop1 = nn.Dropout(dropout)
        self.ln1 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)
        self.drop2 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply both residual sub-layers, normalising after each."""
        x = self.ln1(x + self.drop1(self.attn(x)))
        return self.ln2(x + self.drop2(self.mlp(x)))


class BERT(nn.Module):
    """BERT masked-language model whose forward returns the MLM loss."""

    def __init__(self, layers: int, heads: int, hidden: int, seq_len: int,
                 vocab: int, dropout: float = 0.0):
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.ln_emb = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.head_dense = nn.Linear(hidden, hidden)
        self.head_ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        init_weights(self)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Return mean cross-entropy over labelled positions (labels != -100)."""
        logits = self.logits(tokens)
        return F.cross_entropy(
            logits.view(-1, self.vocab), labels.view(-1), ignore_index=IGNORE_INDEX
        )

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The MLM logits (B, T, vocab) of `tokens` (B, T)."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.ln_emb(self.wte(tokens) + self.wpe(pos)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.head_ln(F.gelu(self.head_dense(x))))


def mlm_batch(
    tokens: torch.Tensor, generator: torch.Generator, mask_prob: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask `tokens` (B, T), drawing the positions from `generator`:
    (masked tokens, labels).

    Tokens must avoid id 0 so that a masked position is always visibly
    masked. Each row gets one forced labelled position on top of the ~15%
    random ones, because a row (or a micro-batch of one row) with no labels
    would make the mean loss 0/0 = NaN.
    """
    batch_size, seq_len = shape = tokens.shape
    masked = torch.rand(shape, generator=generator) < mask_prob
    forced = torch.randint(0, seq_len, (batch_size,), generator=generator)
    masked[torch.arange(batch_size), forced] = True
    labels = torch.where(masked, tokens, torch.full_like(tokens, IGNORE_INDEX))
    inputs = torch.where(masked, torch.full_like(tokens, MASK_TOKEN), tokens)
    return inputs, labels
