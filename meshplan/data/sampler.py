"""Samples of a token split and the seeded order in which training reads them.

Invariants:
- Sample `i` for `seq_len` is `tokens[i*seq_len : i*seq_len + seq_len + 1]`:
  seq_len+1 tokens (inputs and their shifted targets), consecutive samples
  overlapping by one token; a split of T tokens has `(T - 1) // seq_len`.
- A global position `p` (the caller's `step * global_batch_size + j`) reads
  sample `perm_e(p % N)` of epoch `e = p // N`. `perm_e` is a pure function
  of (seed, epoch) and a permutation of range(N), so every epoch reads every
  sample exactly once, the same on every rank and every restart.
- The order takes O(1) memory: `perm_e` is a balanced Feistel network
  over the smallest even-bit power-of-two domain >= N (6 rounds, round keys
  a hash of (seed, epoch, round)), cycle-walked back below N (a walk
  repeats the bijection, so it stays a permutation of range(N)); never a
  materialized `np.random.permutation(N)`.
- `SampleReader.read` touches only the memmap pages of the samples asked for,
  and unmaps them again (`TokenData.release`).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from meshplan.data.tokens import TokenData
from meshplan.errors import ConfigError

ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def num_samples(n_tokens: int, seq_len: int) -> int:
    """How many samples of seq_len+1 tokens a split of `n_tokens` holds."""
    return max(0, (n_tokens - 1) // seq_len)


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    keys = []
    for r in range(ROUNDS):
        digest = hashlib.blake2b(f"meshplan.sampler:{seed}:{epoch}:{r}".encode(), digest_size=8)
        keys.append(np.uint64(int.from_bytes(digest.digest(), "little")))
    return keys


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast, well-spread uint64 -> uint64 hash."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, half: int, keys: list[np.uint64]) -> np.ndarray:
    """One pass of the balanced Feistel bijection on [0, 4**half)."""
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << shift) | right


def permute(indices: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """`perm(indices)` for the (seed, epoch) permutation of range(n); indices in [0, n)."""
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    keys = _round_keys(seed, epoch)
    out = _feistel(np.asarray(indices, dtype=np.uint64), half, keys)
    outside = out >= np.uint64(n)
    while outside.any():  # cycle-walk only the elements still out of range
        out[outside] = _feistel(out[outside], half, keys)
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


def sample_ids(positions, n: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The sample ids (int64) that global `positions` read from a split of `n` samples."""
    p = np.asarray(positions, dtype=np.int64).reshape(-1)
    if len(p) and p.min() < 0:
        raise ConfigError(f"sample positions must be >= 0, got {int(p.min())}")
    if n <= 0:
        raise ConfigError("a split with no samples cannot be read; lower --seq-len or "
                          "prepare more text")
    if not shuffle:
        return p % n
    epochs, within = p // n, p % n
    out = np.empty_like(p)
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = permute(within[sel], n, seed, int(e))
    return out


class SampleReader:
    """Reads samples of one split for `seq_len`, in the order of `seed`.

    `read(positions)` returns an int64 tensor [len(positions), seq_len+1];
    `rows_read` counts the samples read so far.
    """

    def __init__(self, data: TokenData, seq_len: int, seed: int, shuffle: bool = True):
        data.check_seq_len(seq_len)
        self.data, self.seq_len, self.seed, self.shuffle = data, seq_len, seed, shuffle
        self.num_samples = num_samples(len(data.tokens), seq_len)
        self.rows_read = 0
        self.last_ids = np.empty(0, dtype=np.int64)  # the ids the last `read` read
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    def sample_ids(self, positions) -> np.ndarray:
        """The sample ids `positions` read (see the module docstring)."""
        return sample_ids(positions, self.num_samples, self.seed, self.shuffle)

    def read(self, positions) -> torch.Tensor:
        """The samples at global `positions`: LongTensor [len(positions), seq_len+1]."""
        ids = self.last_ids = self.sample_ids(positions)
        idx = ids[:, None] * self.seq_len + self._offsets[None, :]
        rows = np.asarray(self.data.tokens[idx]).astype(np.int64)
        self.data.release()  # resident memory stays flat (tokens.py)
        self.rows_read += len(ids)
        return torch.from_numpy(rows)
