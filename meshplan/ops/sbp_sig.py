"""SBP signatures: what an op needs of its inputs and gives on its outputs,
along ONE mesh axis.

Invariants:
- A rule `sbp(args, kwargs, outs, n) -> list[SbpSig]` sees the op's argument
  signature (`TensorMeta`s in place of Refs), its output metas and the axis
  size `n`; `ins`
  follows the op's tensor arguments in traversal order (`Op.refs()`), `outs`
  the op's outputs (None for an absent output).
- The list is in order of preference: propagation breaks cost ties by it.
  Every list holds the all-Replicate signature, which is always correct.
- `variant` names a rank-dependent variant of the kernel that lowering applies
  (e.g. `KernelVariant.BIAS_FIRST`: only the axis's first rank adds the
  bias), `KernelVariant.NONE` ("") if none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from meshplan.ir import TensorMeta
from meshplan.ir.choices import KernelVariant
from meshplan.ir.sbp import Partial, Replicate, Sbp

R = Replicate()
P = Partial()


Outs = tuple[Optional[TensorMeta], ...]  # an op's output metas (None: absent)


@dataclass(frozen=True, slots=True)
class SbpSig:
    ins: tuple[Sbp, ...]
    outs: tuple[Sbp | None, ...]
    variant: KernelVariant = KernelVariant.NONE


# sbp(signature args, signature kwargs, outs, axis size) -> signatures, preferred first
SbpRule = Callable[[tuple, dict, Outs, int], list[SbpSig]]


def tensors(sig: Any) -> list[TensorMeta]:
    """The TensorMetas of an argument signature, in traversal order."""
    out: list[TensorMeta] = []
    stack = [sig]
    while stack:
        a = stack.pop()
        if isinstance(a, TensorMeta):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            stack.extend(reversed(a))
        elif isinstance(a, dict):  # kwargs, after the positional arguments (`Op.refs()`)
            stack.extend(reversed(list(a.values())))
    return out


def out_meta(outs: Outs, i: int = 0) -> TensorMeta:
    """Output `i`'s meta, which the rule asking needs present."""
    meta = outs[i]
    assert meta is not None, f"output {i} is absent"
    return meta


def replicated(n_in: int, n_out: int) -> SbpSig:
    return SbpSig((R,) * n_in, (R,) * n_out)


def same(n_in: int, n_out: int, s: Sbp) -> SbpSig:
    return SbpSig((s,) * n_in, (s,) * n_out)


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def divisible(size: int, n: int) -> bool:
    return size % n == 0
