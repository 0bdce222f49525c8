"""Paired samples: a source and its target (`prepare-data --target-field`:
a text and its translation, a prompt and its answer) as a model's
(inputs, labels).

Invariants:
- Sample `i` of a paired split is pair `i`; a global position reads pair
  `sample_ids(p)` of the same seeded order as token samples
  (`data/sampler.py`), so what a rank reads is a pure function of (seed,
  step, row), the same at any layout.
- Each row fits `seq_len` by cutting, never by dropping the row: a part
  cut short keeps its first tokens, and a source keeps its closing eod
  (the separator a model learns to answer after).
- `SOURCE_TARGET` (an encoder-decoder): inputs are the source padded with
  `pad` (the model masks it out of attention) to [n, seq_len], labels the
  target padded with `IGNORE_INDEX` to [n, target_len] (seq_len unless
  the model's own).
- `JOINED` / `JOINED_SHIFTED` (a causal LM): the row is source then target,
  padded with eod; only the target's tokens are labelled. The source is
  cut first, to no less than half the row, so every row labels at least
  one token: a micro-batch never averages its loss over nothing.
- `PACKED` / `PACKED_SHIFTED` (a causal LM, `--pack`): each row holds
  whole pairs, next-fit in the seeded order of each epoch (`pack_rows`),
  each laid out and cut as in `JOINED_SHIFTED` (a row of `seq_len`, labels
  the next tokens for the zoo's GPT), with position ids that restart at 0
  at each pair, from which the model masks attention to the pair's own
  tokens (transformers; the zoo's `gpt.pair_mask`); the row's tail is
  eod, unlabelled, positions of a document of its own. Row `r` is a pure
  function of (seed, r): each rank packs the epochs up to the one it
  reads (one pass over the pairs' lengths each; the rows of every epoch
  and the starts of the last two are kept, so memory does not grow with
  the run).
- Reads touch only the pages of the pairs asked for, then release them
  (`TokenData.release`).
"""

from __future__ import annotations

import numpy as np
import torch

from meshplan.data.masking import IGNORE_INDEX
from meshplan.data.sampler import permute, sample_ids
from meshplan.data.tokens import TokenData


class PairReader:
    """Reads pairs of one paired split in the order of `seed`: `read`
    returns each position's (source, target), each with its eod."""

    def __init__(self, data: TokenData, seq_len: int, seed: int, shuffle: bool = True):
        assert data.pairs is not None, data.data_dir
        data.check_seq_len(seq_len)
        self.data, self.seq_len, self.seed, self.shuffle = data, seq_len, seed, shuffle
        self.num_samples = data.documents
        self.rows_read = 0
        self.last_ids = np.empty(0, dtype=np.int64)  # the ids the last `read` read

    def sample_ids(self, positions) -> np.ndarray:
        """The pair ids `positions` read."""
        return sample_ids(positions, self.num_samples, self.seed, self.shuffle)

    def read(self, positions) -> list[tuple[np.ndarray, np.ndarray]]:
        """The (source, target) int64 arrays of the pairs at `positions`."""
        ids = self.last_ids = self.sample_ids(positions)
        out = []
        for i in ids.tolist():
            start = int(self.data.ends[i - 1, 1]) if i else 0
            mid, end = (int(e) for e in self.data.ends[i])
            row = np.asarray(self.data.tokens[start:end]).astype(np.int64)
            out.append((row[:mid - start], row[mid - start:]))
        self.data.release()
        self.rows_read += len(ids)
        return out


def pair_lengths(data: TokenData) -> np.ndarray:
    """Each pair's tokens (source and target, with their eods), int32
    [pairs]: what packing an epoch needs in memory, 4 bytes a pair."""
    ends = np.asarray(data.ends[:, 1]).astype(np.int64)
    data.release()
    return np.diff(ends, prepend=0).astype(np.int32)


def pack_rows(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Next-fit packing of pairs of `lengths` (in order) into rows of
    `budget` tokens: the start of each row and, last, the end. A row takes
    the next pairs while they fit; a pair longer than `budget` is a row of
    its own (and cut)."""
    cum = np.concatenate([[0], np.cumsum(np.minimum(lengths, budget), dtype=np.int64)])
    starts = [0]
    while starts[-1] < len(lengths):
        s = starts[-1]
        starts.append(max(s + 1, int(np.searchsorted(cum, cum[s] + budget, side="right")) - 1))
    return np.asarray(starts, dtype=np.int64)


class PackedPairReader:
    """Reads rows of packed pairs (`PACKED`): `read` returns each row
    position's pairs, (source, target) each, in the order they are laid out."""

    def __init__(self, data: TokenData, seq_len: int, seed: int, shuffle: bool = True):
        self.pairs = PairReader(data, seq_len, seed, shuffle)
        self.lengths = pair_lengths(data)
        sample_ids([], len(self.lengths), seed)  # no pairs: one line, as the others read
        self.seq_len, self.seed, self.shuffle = seq_len, seed, shuffle
        self.first_rows = [0]  # the global row each epoch packed so far starts at, and the next
        self._starts: dict[int, np.ndarray] = {}  # the row starts of the last epochs used
        self.rows_read = 0
        self.last_ids = np.empty(0, dtype=np.int64)

    def _starts_of(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s row starts (kept for the last two epochs used:
        memory does not grow with the run)."""
        if epoch not in self._starts:
            n = len(self.lengths)
            order = np.arange(n, dtype=np.int64)
            if self.shuffle:
                order = permute(order, n, self.seed, epoch)
            if len(self._starts) >= 2:
                del self._starts[min(self._starts)]
            self._starts[epoch] = pack_rows(self.lengths[order], self.seq_len)
        return self._starts[epoch]

    def _locate(self, row: int) -> tuple[int, int]:
        """(epoch, row within it) of global row `row`, packing epochs as needed."""
        while self.first_rows[-1] <= row:
            self.rows_in_epoch(len(self.first_rows) - 1)
        e = int(np.searchsorted(self.first_rows, row, side="right")) - 1
        return e, row - self.first_rows[e]

    def rows_in_epoch(self, epoch: int) -> int:
        """The rows epoch `epoch` packs into."""
        while len(self.first_rows) <= epoch + 1:
            e = len(self.first_rows) - 1
            self.first_rows.append(self.first_rows[-1] + len(self._starts_of(e)) - 1)
        return self.first_rows[epoch + 1] - self.first_rows[epoch]

    def read(self, positions) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """The pairs of the rows at global `positions`."""
        spans = []
        for p in np.asarray(positions, dtype=np.int64).tolist():
            e, r = self._locate(p)
            starts = self._starts_of(e)
            lo, hi = starts[r], starts[r + 1]
            spans.append(e * len(self.lengths) + np.arange(lo, hi, dtype=np.int64))
        flat = self.pairs.read(np.concatenate(spans)) if spans else []
        self.last_ids = self.pairs.last_ids
        self.rows_read += len(spans)
        out, at = [], 0
        for s in spans:
            out.append(flat[at:at + len(s)])
            at += len(s)
        return out


def cut_shares(data: TokenData, seq_len: int, target_len: int = 0,
               joined_budget: int = 0) -> dict[str, float]:
    """The shares of a paired split's pairs that its rows cut: of sources
    longer than `seq_len` and of targets longer than `target_len` (0:
    `seq_len`), or with `joined_budget` (a causal LM's row: `seq_len + 1`,
    or `seq_len` for a model that shifts its labels) of pairs longer than
    that. Read in chunks of the `.idx`: memory does not grow with it."""
    n = len(data.ends)
    counts = np.zeros(2, dtype=np.int64)
    chunk = 1 << 22
    for lo in range(0, n, chunk):
        ends = np.asarray(data.ends[lo:lo + chunk]).astype(np.int64)
        start = np.concatenate([[int(data.ends[lo - 1, 1]) if lo else 0], ends[:-1, 1]])
        source, target = ends[:, 0] - start, ends[:, 1] - ends[:, 0]
        if joined_budget:
            counts[0] += int((source + target > joined_budget).sum())
        else:
            counts += [int((source > seq_len).sum()), int((target > (target_len or seq_len)).sum())]
    data.release()
    shares = counts / max(n, 1)
    return {"pairs": float(shares[0])} if joined_budget else \
        {"sources": float(shares[0]), "targets": float(shares[1])}


def _cut(ids: np.ndarray, n: int) -> np.ndarray:
    """`ids` cut to `n` tokens, keeping its last one (its eod)."""
    return ids if len(ids) <= n else np.concatenate([ids[:n - 1], ids[-1:]])


def source_target(pairs: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad: int,
                  target_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An encoder-decoder's (inputs, labels): sources padded with `pad`,
    targets with `IGNORE_INDEX` (see the module docstring)."""
    target_len = target_len or seq_len
    x = np.full((len(pairs), seq_len), pad, dtype=np.int64)
    y = np.full((len(pairs), target_len), IGNORE_INDEX, dtype=np.int64)
    for row, (source, target) in enumerate(pairs):
        source, target = _cut(source, seq_len), _cut(target, target_len)
        x[row, :len(source)] = source
        y[row, :len(target)] = target
    return torch.from_numpy(x), torch.from_numpy(y)


def _fit(source: np.ndarray, target: np.ndarray, budget: int
         ) -> tuple[np.ndarray, np.ndarray]:
    """A pair cut to `budget` tokens: the source first, to no less than half."""
    keep = min(len(source), max(budget - len(target), budget // 2))
    source = _cut(source, keep)
    return source, target[:budget - len(source)]


def joined(pairs: list[tuple[np.ndarray, np.ndarray]], seq_len: int, eod: int,
           shifted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's (inputs, labels) of source then target, labelled on
    the target: labels the next tokens, or (`shifted`, a model that shifts
    them itself) the tokens in place."""
    budget = seq_len + (not shifted)  # the positions a label can reach
    s = np.full((len(pairs), seq_len + 1), eod, dtype=np.int64)
    learn = np.zeros(s.shape, dtype=bool)
    for row, (source, target) in enumerate(pairs):
        source, target = _fit(source, target, budget)
        s[row, :len(source)] = source
        s[row, len(source):len(source) + len(target)] = target
        learn[row, len(source):len(source) + len(target)] = True
    x = s[:, :-1]
    y = np.where(learn[:, :-1], x, IGNORE_INDEX) if shifted else \
        np.where(learn[:, 1:], s[:, 1:], IGNORE_INDEX)
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)


def packed(rows: list[list[tuple[np.ndarray, np.ndarray]]], seq_len: int, eod: int,
           shifted: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A causal LM's (inputs, labels, position ids) of packed rows: each
    pair source then target, labelled on the target (in place, `shifted`:
    a transformers model shifts them; else the next tokens), its positions
    from 0; the tail eod, unlabelled (the module docstring)."""
    x = np.full((len(rows), seq_len), eod, dtype=np.int64)
    y = np.full(x.shape, IGNORE_INDEX, dtype=np.int64)
    pos = np.zeros(x.shape, dtype=np.int64)
    for row, pairs in enumerate(rows):
        at = 0
        for source, target in pairs:
            source, target = _fit(source, target, seq_len)
            n = len(source) + len(target)
            assert at + n <= seq_len, (at, n, seq_len)  # pack_rows fitted them
            x[row, at:at + len(source)] = source
            x[row, at + len(source):at + n] = y[row, at + len(source):at + n] = target
            pos[row, at:at + n] = np.arange(n)
            at += n
        pos[row, at:] = np.arange(seq_len - at)
    if not shifted:  # position i predicts token i + 1 where that is a target token: a pair
        # begins with its source (at least its eod), so i is of the same pair
        y = np.concatenate([y[:, 1:], np.full((len(rows), 1), IGNORE_INDEX)], axis=1)
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(pos)
