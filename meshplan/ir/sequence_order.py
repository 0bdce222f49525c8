"""The order context parallelism computes a sequence in (a Strategy's fact).

With `cp > 1` and `cp_balance` (the default), the forward runs on the
sequence reordered so that the contiguous split over cp gives rank r the
chunks r and 2cp-1-r of 2cp (`zigzag`): causal attention's work is then
the same on every rank. Position p of the computed sequence holds token
`sequence_order(strategy, seq)[p]`.
"""

from __future__ import annotations


def zigzag(seq: int, cp: int) -> list[int]:
    """The sequence's positions in the balanced order: 2cp chunks, rank r's
    part of the contiguous split holding chunks r and 2cp-1-r."""
    c = seq // (2 * cp)
    out: list[int] = []
    for k in chunk_order(cp):
        out += range(k * c, (k + 1) * c)
    return out


def chunk_order(cp: int) -> list[int]:
    """The 2cp chunks in computed order: r and 2cp-1-r for each rank r."""
    return [k for r in range(cp) for k in (r, 2 * cp - 1 - r)]


def sequence_order(strategy, seq: int) -> list[int]:
    """The token at each position of the sequence as `strategy` computes it."""
    if strategy.cp > 1 and strategy.cp_balance:
        return zigzag(seq, strategy.cp)
    return list(range(seq))
