"""Decoder-only GPT (pre-LN) as a plain `nn.Module`.

Invariants:
- Module paths are part of the public contract, because sharding rules and
  layer patterns match them: `wte`, `wpe`, `blocks.{i}.{ln1,attn.qkv,
  attn.proj,ln2,mlp.fc1,mlp.fc2}`, `ln_f`, `head`.
- The qkv output is laid out head-major, `(heads, 3 * head_dim)`, so a
  contiguous split of `attn.qkv`'s output features hands whole heads (each
  with its own q, k and v) to a tensor-parallel rank.
- With `tie_embeddings`, `head.weight` is `wte.weight` (one parameter under
  two names, as in GPT-2); tensor parallelism splits it by vocabulary rows
  for both uses (`vocab` style, S(0)), and pipelining gives a copy to the
  first and the last stage (docs/concepts/sbp.md, shared parameters).
- `forward(tokens, targets)` returns the scalar mean cross-entropy loss and
  has no Python control flow on tensor values, so it captures to one graph.
- Packed rows (`--pack`, `data/pairs.py`) come with `positions`, which
  restart at 0 at each pair: they index `wpe`, and attention is causal
  within each pair only (`pair_mask`), so a packed pair computes what it
  would alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02


class Attention(nn.Module):
    """Multi-head self-attention with a fused, head-major qkv projection."""

    def __init__(self, hidden: int, heads: int, dropout: float, causal: bool):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.dropout = dropout
        self.causal = causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend over the sequence; `x` is (B, T, hidden); `mask` (B, 1, T, T),
        True where a query may attend a key, replaces the causal mask."""
        batch, seq, hidden = x.shape
        # Head-major view: each head's q, k, v sit next to each other, so a
        # column split of qkv over ranks never cuts a head in two.
        qkv = self.qkv(x).view(batch, seq, self.heads, 3 * self.head_dim)
        q, k, v = qkv.transpose(1, 2).split(self.head_dim, dim=-1)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                           is_causal=self.causal and mask is None)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    """Two-layer feed-forward network with a 4x expansion and exact GELU."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply fc1, GELU, fc2."""
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """One pre-LN transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, dropout, causal=True)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply both residual sub-layers (`mask`: the attention's, packed rows)."""
        x = x + self.drop1(self.attn(self.ln1(x), mask))
        return x + self.drop2(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """GPT language model whose forward returns the next-token loss."""

    def __init__(self, layers: int, heads: int, hidden: int, seq_len: int,
                 vocab: int, dropout: float = 0.0, tie_embeddings: bool = False):
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tie_embeddings:
            self.head.weight = self.wte.weight
        init_weights(self)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Return mean cross-entropy of predicting `targets` from `tokens` (both
        B, T; `positions` of packed rows, see the module docstring)."""
        logits = self.logits(tokens, positions)
        return F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1))

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The next-token logits (B, T, vocab) of `tokens` (B, T)."""
        mask = None if positions is None else pair_mask(positions)
        pos = torch.arange(tokens.shape[1], device=tokens.device) if positions is None \
            else positions
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def pair_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) True where query i may attend key j: j <= i, in i's pair
    (a pair starts where `positions` (B, T) is 0)."""
    pair = torch.cumsum(positions == 0, dim=1)
    seq = positions.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return ((pair[:, :, None] == pair[:, None, :]) & causal)[:, None]


def init_weights(model: nn.Module) -> None:
    """GPT-2 style init: N(0, 0.02) weights, zero biases; no-op on meta.

    The small std keeps the initial logits near zero, so the loss at init is
    about ln(vocab) (a cheap sanity check for tests and benchmarks).
    """
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if module.weight.is_meta:
                # Meta tensors have no storage; skip to keep 175B builds fast.
                continue
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            bias = getattr(module, "bias", None)
            if bias is not None:
                nn.init.zeros_(bias)
