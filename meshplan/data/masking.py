"""Masked-token noise: how a token sample becomes a masked LM's (inputs,
labels), or an encoder-decoder's denoising pair.

Invariants:
- A sample's noise is a pure function of (seed, the sample's global
  position in the run): `positions` are the sampler's (`data/feed.py`), so
  every rank reading its rows, the eager reference reading the whole batch,
  and a run resumed at another layout mask the same tokens. A sample read
  again in a later epoch is at another position, so it is masked anew
  (dynamic masking, as RoBERTa).
- `MASKED` (BERT's recipe, as transformers' `DataCollatorForLanguageModeling`):
  each position is chosen with probability `rate`; of the chosen, 80% become
  `mask_id`, 10% a token drawn uniformly from the data's vocabulary, 10% stay;
  labels are the original tokens where chosen, `IGNORE_INDEX` elsewhere.
- `DENOISE` (an encoder-decoder's): every chosen position becomes `mask_id`;
  the labels are the whole original sample.
- The document separator (`eod`) is never chosen. Every row has at least
  one chosen position (one drawn at random when the draw chose none), so a
  micro-batch of one row never averages its loss over nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100  # cross entropy's default ignore_index: no loss at this position
_STREAM = 0x6D61736B  # "mask": these draws' own stream, apart from the sampler's


@dataclass(frozen=True, slots=True)
class Noise:
    """What masks a sample: the id written at a masked position, the data's
    vocabulary (random replacements are drawn below it), its separator."""

    mask_id: int
    vocab_size: int
    eod: int
    rate: float
    seed: int


def mask_rows(x: torch.Tensor, positions: np.ndarray, noise: Noise,
              whole_labels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of the samples `x` [n, T] at global `positions` [n]:
    BERT's recipe, or (`whole_labels`) every chosen token masked and the
    whole sample the labels (see the module docstring)."""
    tokens = x.numpy()
    inputs = tokens.copy()
    chosen = np.zeros(tokens.shape, dtype=bool)
    n = tokens.shape[1]
    for row, position in enumerate(np.asarray(positions, dtype=np.int64).tolist()):
        rng = np.random.default_rng([noise.seed, position, _STREAM])
        u, kind = rng.random(n), rng.random(n)
        other: np.ndarray = rng.integers(0, noise.vocab_size, size=(n,))
        may = tokens[row] != noise.eod
        pick = (u < noise.rate) & may
        if not pick.any() and may.any():
            pick[rng.choice(np.flatnonzero(may))] = True
        chosen[row] = pick
        if whole_labels:
            inputs[row, pick] = noise.mask_id
            continue
        inputs[row, pick & (kind < 0.8)] = noise.mask_id
        swap = pick & (kind >= 0.8) & (kind < 0.9)
        inputs[row, swap] = other[swap]
    labels = tokens.copy() if whole_labels else np.where(chosen, tokens, IGNORE_INDEX)
    return torch.from_numpy(inputs), torch.from_numpy(labels)
