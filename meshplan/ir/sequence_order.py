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


def causal_pairs(strategy, seq: int, rows: tuple[int, int], keys: tuple[int, int]) -> int:
    """The (query, key) pairs a causal attention keeps between the computed
    positions `rows` [lo, hi) and `keys` [lo, hi): those whose key's token is
    at most its query's. Exact, in closed form over the order's runs of
    consecutive tokens (2cp of them when balanced), not per position."""
    runs = _runs(strategy.cp if strategy.cp > 1 and strategy.cp_balance else 1, seq)
    return sum(_below(a, a + n, c, c + m) for a, n in _cut(runs, *rows)
               for c, m in _cut(runs, *keys))


def runs_at(strategy, seq: int, lo: int, hi: int) -> tuple[tuple[int, int, int], ...]:
    """(row from `lo`, first token, length) of each run of consecutive
    tokens at the computed positions [lo, hi), in order; adjacent runs joined."""
    out: list[tuple[int, int, int]] = []
    row = 0
    for token, n in _cut(_runs(strategy.cp if strategy.cp > 1 and strategy.cp_balance else 1,
                               seq), lo, hi):
        if out and out[-1][1] + out[-1][2] == token:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((row, token, n))
        row += n
    return tuple(out)


def _runs(cp: int, seq: int) -> tuple[tuple[int, int, int], ...]:
    """(position, first token, length) of each run of the order."""
    if cp == 1:
        return ((0, 0, seq),)
    c = seq // (2 * cp)
    return tuple((i * c, k * c, c) for i, k in enumerate(chunk_order(cp)))


def _cut(runs, lo: int, hi: int) -> list[tuple[int, int]]:
    """(first token, length) of the runs' parts at positions [lo, hi)."""
    out = []
    for pos, token, n in runs:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((token + a - pos, b - a))
    return out


def _below(a: int, b: int, c: int, d: int) -> int:
    """Pairs (p, k), p in [a, b), k in [c, d), with k <= p."""
    total = 0
    lo, hi = max(a, c), min(b, d)
    if lo < hi:  # p inside the keys: p - c + 1 of them
        total += (hi - lo) * ((lo - c + 1) + (hi - c)) // 2
    if b > max(a, d):  # p past the keys: all d - c
        total += (b - max(a, d)) * (d - c)
    return total
