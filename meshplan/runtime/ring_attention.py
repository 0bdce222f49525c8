"""Ring attention (`--cp-attention ring`, `KernelVariant.RING`): attention
of a rank's rows of the sequence, its keys and values passed around the
ring of its context-parallel line.

A rank holds its rows of the queries, keys and values (the split over cp,
in the order the strategy computes the sequence: `ir/sequence_order.py`).
At ring step s it computes its queries against the block of keys and
values that the rank s places before it holds, while that block travels
one place on; the blocks' results merge by their log-sum-exps (the online
softmax), so after cp steps each row has attended to every key. The
backward passes the blocks around again, with each block's key and value
gradients travelling with it and accumulating; one more step brings each
rank its own block's complete gradients.

Invariants:
- Each block runs the op's own kernel (the CPU flash kernel, or the
  device's, `Task.kernel`), on the pairs of runs of consecutive tokens
  (`sequence_order.runs_at`) that see anything: a pair whose keys all come
  after its queries is skipped; one whose keys all come before is computed
  unmasked; a run against itself is the kernel's causal form; any other
  pair gets the causal mask at its tokens, on the rows that see a key. So
  under the load-balanced order every rank computes the same pairs.
- The backward of a block is the kernel's own backward given the whole
  row's output and log-sum-exp: exactly that block's part of the gradients.
- Merges and accumulations are in fp32 (or the inputs' wider dtype);
  outputs are cast to the inputs' dtype.
- Every member posts its sends before it waits on a receive, and all run
  the same steps in the same order (`check` proves the ring ops' order per
  group as any collective's): no deadlock.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from meshplan.runtime.local_kernels import causal_mask

Runs = tuple[tuple[int, int, int], ...]  # (local row, first token, length)
# shift(x, step) -> take(): x sent to the next member, the previous one's received
Shift = Callable[[torch.Tensor, int], Callable[[], torch.Tensor]]
Record = Callable[[str, float], None]  # record(name, t0): a span from t0 to now (a trace)


def _no_record(name: str, t0: float) -> None:
    pass


def _pairs(rows: Runs, keys: Runs, causal: bool):
    """(q slice, k slice, is_causal, mask positions or None) of each pair of
    runs that sees a key; a q slice starts at the run's first row that does."""
    for r0, a, n in rows:
        for c0, c, m in keys:
            if not causal or c + m - 1 <= a:  # every key at or before every query
                yield slice(r0, r0 + n), slice(c0, c0 + m), False, None
            elif c > a + n - 1:  # every key after every query
                continue
            elif a == c and n == m:  # a run against itself
                yield slice(r0, r0 + n), slice(c0, c0 + m), True, None
            else:  # rows before the keys' first token see none of them
                lo = max(a, c)
                yield (slice(r0 + lo - a, r0 + n), slice(c0, c0 + m), False,
                       (range(lo, a + n), range(c, c + m)))


def _mask(where, like: torch.Tensor):
    return None if where is None else causal_mask(*where, like)


def ring_attention(kernel, rows: Runs, keys: list[Runs], me: int, shift: Shift,
                   record: Record = _no_record):
    """The flash forward (q, k, v, dropout_p, is_causal, *, attn_mask, scale)
    -> (out, lse) of rank `me` of the ring, `keys[j]` the runs member j holds;
    each step's blocks `record`ed as one span."""
    n = len(keys)

    def attention(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        assert dropout_p == 0.0 and attn_mask is None, "ring attention: no dropout or mask"
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(q.shape, dtype=acc)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        for s in range(n):
            take = shift(kv, s) if s < n - 1 else None
            t0 = time.perf_counter()
            for qs, ks, causal, where in _pairs(rows, keys[(me - s) % n], is_causal):
                o, m = kernel(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], 0.0, causal,
                              attn_mask=_mask(where, q), scale=scale)
                _merge(out[:, :, qs], lse[:, :, qs], o, m)
            record(f"ring F block of {(me - s) % n}", t0)
            if take is not None:
                kv = take()
        return out.to(q.dtype), lse

    return attention


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, m: torch.Tensor) -> None:
    """Rows' (out, lse) so far, in place, merged with a block's (o, m)."""
    new = torch.logaddexp(lse, m.to(lse.dtype))
    out.mul_((lse - new).exp().unsqueeze(-1)).add_(o.to(out.dtype) * (m - new).exp().unsqueeze(-1))
    lse.copy_(new)


def ring_attention_backward(kernel, rows: Runs, keys: list[Runs], me: int, shift: Shift,
                            record: Record = _no_record):
    """The flash backward (g, q, k, v, out, lse, dropout_p, is_causal, *,
    attn_mask, scale) -> (dq, dk, dv) of rank `me` of the ring."""
    n = len(keys)

    def backward(g, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                 scale=None):
        assert dropout_p == 0.0 and attn_mask is None, "ring attention: no dropout or mask"
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = q.new_zeros(q.shape, dtype=acc)
        kv = torch.stack((k, v))
        grads = None  # the travelling gradients of the block held, once received
        for s in range(n):
            take = shift(kv, 2 * s) if s < n - 1 else None
            mine = kv.new_zeros(kv.shape, dtype=acc)
            t0 = time.perf_counter()
            for qs, ks, causal, where in _pairs(rows, keys[(me - s) % n], is_causal):
                gq, gk, gv = kernel(g[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                    out[:, :, qs], lse[:, :, qs], 0.0, causal,
                                    attn_mask=_mask(where, q), scale=scale)
                dq[:, :, qs] += gq
                mine[0][:, :, ks] += gk
                mine[1][:, :, ks] += gv
            record(f"ring B block of {(me - s) % n}", t0)
            if grads is not None:
                mine += grads()
            grads = shift(mine, 2 * s + 1)  # on to the next holder; the last step's: home
            if take is not None:
                kv = take()
        assert grads is not None
        dkv = grads()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)

    return backward
