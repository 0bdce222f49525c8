"""Cost model per op: flops (exact for the hot ops) and bytes moved.

Invariant: functions take the op's argument *signature* (Refs replaced by
`TensorMeta`s, see `infer.to_sig`), never tensors, so costs are computed
without running anything and can be cached by signature.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from meshplan.ir import TensorMeta

FlopsFn = Callable[[tuple], float]  # (argument signature) -> flops


def _shape(m: Any) -> tuple[int, ...]:
    return m.shape if isinstance(m, TensorMeta) else ()


def linear_flops(args: tuple) -> float:
    x, w = args[0], args[1]
    return 2.0 * math.prod(_shape(x)) * _shape(w)[0]


def mm_flops(args: tuple) -> float:
    a, b = _shape(args[0]), _shape(args[1])
    if len(a) < 1 or len(b) < 1:
        return 0.0
    batch = math.prod(a[:-2]) if len(a) > 2 else 1
    rows = a[-2] if len(a) > 1 else 1
    return 2.0 * batch * rows * a[-1] * (b[-1] if len(b) > 1 else 1)


def addmm_flops(args: tuple) -> float:
    return mm_flops(args[1:])


def conv2d_flops(args: tuple) -> float:
    x, w = _shape(args[0]), _shape(args[1])
    stride = args[3] if len(args) > 3 else 1
    padding = args[4] if len(args) > 4 else 0
    s = stride if isinstance(stride, int) else stride[0]
    p = padding if isinstance(padding, int) else padding[0]
    if not x or not w or isinstance(p, str):
        return 0.0
    h_out = (x[2] + 2 * p - w[2]) // s + 1
    w_out = (x[3] + 2 * p - w[3]) // s + 1
    return 2.0 * x[0] * w[0] * h_out * w_out * w[1] * w[2] * w[3]


def sdpa_flops(args: tuple) -> float:
    q, k = _shape(args[0]), _shape(args[1])
    *batch, t, d = q
    causal = args[4] if len(args) > 4 else False
    full = 4.0 * math.prod(batch) * t * k[-2] * d
    return full / 2 if causal else full


def backward_of(fwd: FlopsFn, factor: float = 2.0) -> FlopsFn:
    """The flops of a backward op that costs `factor` x its forward."""
    return lambda args: factor * fwd(args[1:])


def bytes_moved(sig_args: tuple, outs: tuple[TensorMeta | None, ...]) -> int:
    """Bytes read and written: every tensor argument plus every output."""
    total = sum(m.nbytes for m in outs if m is not None)
    stack = list(sig_args)
    while stack:
        a = stack.pop()
        if isinstance(a, TensorMeta):
            total += a.nbytes
        elif isinstance(a, (tuple, list)):
            stack.extend(a)
    return total


def conv2d_temp(args: tuple) -> int:
    """im2col column buffer of one image: C_in*kh*kw x H_out*W_out."""
    x, w = args[0].shape, args[1].shape
    stride = args[3] if len(args) > 3 else 1
    s = stride if isinstance(stride, int) else stride[0]
    h_out, w_out = max(x[2] // s, 1), max(x[3] // s, 1)
    return w[1] * w[2] * w[3] * h_out * w_out * args[0].dtype.itemsize


def sdpa_temp(args: tuple) -> int:
    """Flash attention on CPU keeps one block of scores per thread: q_block x kv_block."""
    q = args[0].shape
    return min(q[-2], 256) * min(q[-2], 512) * 4 * 2
