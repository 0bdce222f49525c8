"""`sequence_order.causal_pairs`: the closed form over the order's runs
counts exactly what a position-by-position count of the order does."""

from __future__ import annotations

import bisect
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.ir.sequence_order import causal_pairs, sequence_order


def _by_position(s, seq: int, rows, keys) -> int:
    order = sequence_order(s, seq)
    ks = sorted(order[keys[0]:keys[1]])
    return sum(bisect.bisect_right(ks, p) for p in order[rows[0]:rows[1]])


@settings(max_examples=300, deadline=None)
@given(cp=st.sampled_from([1, 2, 3, 4, 8]), balance=st.booleans(), chunk=st.integers(1, 9),
       cuts=st.lists(st.integers(0, 1000), min_size=4, max_size=4))
def test_closed_form_equals_the_count_by_position(cp, balance, chunk, cuts):
    seq = 2 * cp * chunk
    s = SimpleNamespace(cp=cp, cp_balance=balance)
    a, b, c, d = (x % (seq + 1) for x in cuts)
    rows, keys = (min(a, b), max(a, b)), (min(c, d), max(c, d))
    assert causal_pairs(s, seq, rows, keys) == _by_position(s, seq, rows, keys)
