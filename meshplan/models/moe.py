"""A mixture-of-experts GPT: each block's MLP is E experts, a token takes k.

Invariants:
- Module paths: GPT's (`wte`, `wpe`, `blocks.{i}.{ln1,attn.qkv,attn.proj,ln2}`,
  `ln_f`, `head`), with `blocks.{i}.moe.router` (hidden -> E, no bias) and
  `blocks.{i}.moe.experts.{w1,w2}` ((E, hidden, 4 hidden) and (E, 4 hidden,
  hidden)) for the MLP.
- Routing: softmax over the E router logits, the top k, their weights
  renormalized to sum to 1 (Mixtral's gating; top-1 keeps its probability,
  as Switch does). Each sample's tokens are one
  group: a token's choices queue at their experts in token order, and an
  expert takes at most `capacity` of a group's choices; those beyond it are
  dropped (the token keeps its residual). Dropless (`capacity_factor`
  None): the capacity is the sequence length, so nothing is ever dropped;
  else `ceil(capacity_factor * seq_len * k / E)`, at most the sequence length.
- Static shapes: dispatch and combine are one-hot tensors
  (batch, seq, E, capacity) (GShard's form) applied by batched matmuls, the
  experts one batched matmul over the expert axis, so the step captures to one graph with
  no data-dependent shape, and the expert axis is a tensor dimension a
  layout can split.
- Loss: the mean next-token cross-entropy plus `AUX_COEF` times the sum over
  blocks of the load-balancing loss E * sum_e f_e * P_e (Switch/GShard: f_e
  the fraction of the group's choices routed to e, P_e its mean router
  probability), averaged over the samples.
- Packed rows (`--pack`) come with `positions`, as GPT's (`gpt.pair_mask`):
  attention stays within each pair, positions restart at it. Dropless
  routing is per token, so a packed pair's tokens compute what they do
  alone; a capacity would share a row's slots among its pairs, so packing
  takes the dropless model only (`registry.validate`). The load-balancing
  loss stays the row's: a regularizer over the row's tokens, as over a
  padded row's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.models.gpt import Attention, init_weights, pair_mask

AUX_COEF = 0.01  # the load-balancing loss's weight (Switch Transformer's)


def capacity(seq_len: int, experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Choices one expert takes from one sample (see the module docstring)."""
    if capacity_factor is None:
        return seq_len
    return min(seq_len, math.ceil(capacity_factor * seq_len * top_k / experts))


def capacity_words(seq_len: int, experts: int, top_k: int,
                   capacity_factor: float | None) -> str:
    """The bound on an expert's tokens per sample, as `plan` says it."""
    c = capacity(seq_len, experts, top_k, capacity_factor)
    if capacity_factor is None:
        return f"dropless, {c} tokens per expert and sample (the whole sequence: the worst case)"
    return (f"capacity factor {capacity_factor:g}, {c} tokens per expert and sample "
            "(the rest dropped)")


class Experts(nn.Module):
    """E two-layer GELU MLPs, run as one batched matmul over the expert axis."""

    def __init__(self, experts: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, 4 * hidden))
        self.w2 = nn.Parameter(torch.empty(experts, 4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (batch, E, capacity, hidden) -> the same shape, expert e on row e."""
        batch, e, cap, hidden = x.shape
        rows = x.transpose(0, 1).reshape(e, batch * cap, hidden)  # each expert's rows
        y = torch.bmm(F.gelu(torch.bmm(rows, self.w1)), self.w2)
        return y.reshape(e, batch, cap, hidden).transpose(0, 1)


class MoE(nn.Module):
    """Router, dispatch, experts, combine; returns (output, load-balancing loss)."""

    def __init__(self, hidden: int, experts: int, top_k: int, capacity: int):
        super().__init__()
        self.num_experts, self.top_k, self.capacity = experts, top_k, capacity
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, _ = x.shape
        e, k, cap = self.num_experts, self.top_k, self.capacity
        probs = torch.softmax(self.router(x), dim=-1)  # (B, T, E)
        gate, choice = probs.topk(k, dim=-1)  # (B, T, k)
        if k > 1:  # top-1 keeps its probability, so the router learns from the loss
            gate = gate / gate.sum(dim=-1, keepdim=True)
        chosen = F.one_hot(choice, e).to(x.dtype).reshape(batch, seq * k, e)
        # each choice's place in its expert's queue (token order), and whether it fits
        place = torch.cumsum(chosen, dim=1) - chosen
        kept = chosen * (place < cap).to(x.dtype)
        slot = F.one_hot(place.clamp(max=cap - 1).long(), cap).to(x.dtype) * kept.unsqueeze(-1)
        slot = slot.reshape(batch, seq, k, e, cap)  # (B, T, k, E, C)
        # a token's k choices go to k different experts: (B, T, E * C)
        dispatch = slot.sum(dim=2).reshape(batch, seq, e * cap)
        combine = (slot * gate.reshape(batch, seq, k, 1, 1)).sum(dim=2).reshape(
            batch, seq, e * cap)
        routed = torch.bmm(dispatch.transpose(1, 2), x).reshape(batch, e, cap, -1)
        y = torch.bmm(combine, self.experts(routed).reshape(batch, e * cap, -1))
        share = chosen.mean(dim=1)  # (B, E): f_e, the fraction of choices routed to e
        aux = e * (share * probs.mean(dim=1)).sum(dim=-1).mean()
        return y, aux


class Block(nn.Module):
    """x + attn(ln1(x)), then x + moe(ln2(x)); also returns the moe's aux loss."""

    def __init__(self, hidden: int, heads: int, experts: int, top_k: int, cap: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, 0.0, causal=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, experts, top_k, cap)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x), mask)
        y, aux = self.moe(self.ln2(x))
        return x + y, aux


class MoEGPT(nn.Module):
    """GPT with mixture-of-experts MLPs; forward returns the loss (see above)."""

    def __init__(self, layers: int, heads: int, hidden: int, seq_len: int, vocab: int,
                 experts: int, top_k: int, capacity_factor: float | None):
        super().__init__()
        self.vocab = vocab
        cap = capacity(seq_len, experts, top_k, capacity_factor)
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, experts, top_k, cap)
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        init_weights(self)
        for block in self.blocks:
            for w in (block.moe.experts.w1, block.moe.experts.w2):
                if not w.is_meta:
                    nn.init.normal_(w, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy of predicting `targets` from `tokens` (both B, T),
        plus the weighted load-balancing losses (`positions`: packed rows')."""
        logits, aux = self._run(tokens, positions)
        return F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1)) + AUX_COEF * aux

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
               ) -> torch.Tensor:
        """(B, T, vocab) next-token logits (what `models/generate.py` samples)."""
        return self._run(tokens, positions)[0]

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        mask = None if positions is None else pair_mask(positions)
        pos = torch.arange(tokens.shape[1], device=tokens.device) if positions is None \
            else positions
        x = self.wte(tokens) + self.wpe(pos)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, a = block(x, mask)
            aux = aux + a
        return self.head(self.ln_f(x)), aux


def active_numel(named_params, experts: int, top_k: int) -> int:
    """Parameter elements one token uses: every parameter but the experts it
    does not take (an expert tensor: under `.experts.`, E rows on dim 0)."""
    total = 0
    for name, p in named_params:
        expert = ".experts." in f".{name}" and p.dim() > 0 and p.shape[0] == experts
        total += p.numel() * top_k // experts if expert else p.numel()
    return total
