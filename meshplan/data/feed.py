"""Feeds: a prepared token directory as a model's micro-batches, read rank by
rank.

Invariants:
- A feed is plain data (`TokenFeed`, JSON): what a rank needs to read its
  own rows, and the very thing the eager reference reads with, so both see
  the same samples.
- Sample `j` of step `k`'s global batch is the sampler's global position
  `k * global_batch_size + j` (`data/sampler.py`): a pure function of
  (seed, step, sample index), so a run resumed at another dp reads exactly
  the samples the first would have read next.
- Micro-batch `i` holds the global batch's samples `[i * b, (i + 1) * b)`,
  `b = global_batch_size / num_microbatches`; a rank reads rows `[lo, hi)`
  of each (`runtime/data.data_rows`), nothing else, and none at all when its
  plan reads no data.
- A masked LM's or an encoder-decoder's noise is drawn per global position
  (`data/masking.py`), so it too is the same whatever the layout.
- Paired data (`prepare-data --target-field`) feeds only the paired layouts
  (`PAIRED`) and token data only the others: a mismatch is one line.
- A micro-batch is (inputs, labels), and packed (`PACKED`) also the
  position ids, the model's third input.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum

import numpy as np
import torch

from meshplan.data.masking import Noise, mask_rows
from meshplan.data.pairs import PackedPairReader, PairReader, joined, packed, source_target
from meshplan.data.sampler import SampleReader
from meshplan.data.tokens import TokenData
from meshplan.errors import ConfigError


class Layout(StrEnum):
    """How a sample of `seq_len + 1` tokens becomes a model's (inputs, labels)."""

    NEXT_TOKEN = "next-token"  # (s[:-1], s[1:]): the labels are the next tokens (the zoo)
    SHIFTED_BY_MODEL = "shifted-by-model"  # (s[:-1], s[:-1]): the model shifts (transformers)
    MASKED = "masked"  # s[:-1] masked as BERT's, labelled where masked (a masked LM)
    DENOISE = "denoise"  # s[:-1] masked, labelled whole (an encoder-decoder)
    # paired data (`data/pairs.py`): a source and its target
    SOURCE_TARGET = "source-target"  # the source in, the target labelled (an encoder-decoder)
    JOINED = "joined"  # source then target, the target's next tokens labelled (the zoo)
    JOINED_SHIFTED = "joined-shifted-by-model"  # the same labelled in place (transformers)
    # whole pairs packed into each row, with position ids that restart at each (`--pack`)
    PACKED = "packed"  # the targets' next tokens labelled (the zoo)
    PACKED_SHIFTED = "packed-shifted-by-model"  # labelled in place (transformers)


PAIRED = (Layout.SOURCE_TARGET, Layout.JOINED, Layout.JOINED_SHIFTED, Layout.PACKED,
          Layout.PACKED_SHIFTED)
PACKED = (Layout.PACKED, Layout.PACKED_SHIFTED)


def token_batch(samples: torch.Tensor, layout: Layout, positions: np.ndarray | None = None,
                noise: Noise | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's (inputs, labels) from `samples` [n, seq_len + 1] (read at
    global `positions`, which a masking layout draws its `noise` by)."""
    x = samples[:, :-1].contiguous()
    if layout is Layout.NEXT_TOKEN:
        return x, samples[:, 1:].contiguous()
    if layout is Layout.SHIFTED_BY_MODEL:
        return x, x.clone()
    assert noise is not None and positions is not None, layout
    return mask_rows(x, positions, noise, whole_labels=layout is Layout.DENOISE)


@dataclass(frozen=True, slots=True)
class TokenFeed:
    """One split of a token directory, read as a model's batches."""

    data_dir: str
    split: str  # train | validation
    seq_len: int
    seed: int
    layout: str = Layout.NEXT_TOKEN
    shuffle: bool = True
    mask_id: int = -1  # the id a masking layout writes (the tokenizer's, else vocab_size)
    mask_rate: float = 0.15  # the share of positions a masking layout predicts
    pad_id: int = -1  # the id SOURCE_TARGET pads a source with (the tokenizer's, else vocab_size)
    target_len: int = 0  # SOURCE_TARGET's labels' length (the model's target_len); 0: seq_len

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> TokenFeed:
        return TokenFeed(**json.loads(text))


class FeedReader:
    """A `TokenFeed` opened on one process: micro-batches by step, counting
    the samples it read (`rows_read`)."""

    def __init__(self, feed: TokenFeed, global_batch_size: int, num_microbatches: int):
        self.feed = feed
        self.data = TokenData(feed.data_dir, feed.split)
        self.gbs, self.m = global_batch_size, num_microbatches
        self.layout = Layout(feed.layout)
        if (self.layout in PAIRED) != (self.data.pairs is not None):
            raise ConfigError(
                f"{feed.data_dir} holds {'pairs' if self.data.pairs else 'text'}, and this "
                f"model reads {'pairs' if self.layout in PAIRED else 'text'} ({self.layout}); "
                "prepare the data with --target-field for pairs, without it for text")
        kind = SampleReader if not self.data.pairs else \
            PackedPairReader if self.layout in PACKED else PairReader
        self.reader: SampleReader | PairReader | PackedPairReader = kind(
            self.data, feed.seq_len, feed.seed, shuffle=feed.shuffle)
        self.noise = Noise(feed.mask_id, self.data.vocab_size, self.data.eod, feed.mask_rate,
                           feed.seed)
        self.step_samples: list[int] = []  # the sample ids the last `microbatches` read

    @property
    def rows_read(self) -> int:
        return self.reader.rows_read

    def samples(self) -> int:
        """The rows one pass over the split makes: windows of text, pairs,
        or the rows the first epoch packs its pairs into."""
        if isinstance(self.reader, PackedPairReader):
            return self.reader.rows_in_epoch(0)
        return self.reader.num_samples

    def microbatches(self, step: int, rows: tuple[int, int] | None = None) -> list[tuple]:
        """Step `step`'s micro-batches: rows `[lo, hi)` of each (all of them
        when `rows` is None); [] per micro-batch for `rows` () (no data)."""
        b = self.gbs // self.m
        lo, hi = rows if rows is not None else (0, b)
        out = []
        self.step_samples = []
        for i in range(self.m):
            positions = step * self.gbs + i * b + np.arange(lo, hi, dtype=np.int64)
            out.append(self._batch(positions))
            self.step_samples += self.reader.last_ids.tolist()
        return out

    def _batch(self, positions: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The (inputs, labels) of the samples at global `positions` (and,
        packed, their position ids)."""
        if isinstance(self.reader, SampleReader):
            return token_batch(self.reader.read(positions), self.layout, positions, self.noise)
        if isinstance(self.reader, PackedPairReader):
            return packed(self.reader.read(positions), self.feed.seq_len, self.data.eod,
                          shifted=self.layout is Layout.PACKED_SHIFTED)
        pairs = self.reader.read(positions)
        if self.layout is Layout.SOURCE_TARGET:
            return source_target(pairs, self.feed.seq_len, self.feed.pad_id,
                                 self.feed.target_len)
        return joined(pairs, self.feed.seq_len, self.data.eod,
                      shifted=self.layout is Layout.JOINED_SHIFTED)

    def batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """Step `step`'s whole global batch (the eager reference's)."""
        parts = self.microbatches(step)
        return tuple(torch.cat([p[k] for p in parts]) for k in range(len(parts[0])))
