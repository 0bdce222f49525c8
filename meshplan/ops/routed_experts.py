"""Routed experts: a mixture of experts' expert compute as one op.

    routed_experts(x (T, H), idx (T, k), gates (T, k), w_in, w_out) -> (T, H)
    out[t] = sum_j gates[t, j] * down_{idx[t, j]}(act(gate) * up)(x[t])

It stands for the expert block transformers' MoE models run
(`grouped_mm_experts_forward`: sort the (token, choice) rows by expert, one
grouped matmul in, the gated activation, one grouped matmul out, weigh by
the gates, restore the order, sum the k choices), which capture fuses into
this op (`capture/routed_experts.py`). `w_in` is each expert's gate and up
projections, `(E, 2I, H)` (`(E, H, 2I)` when `transposed`), `w_out` its
down projection, `(E, H, I)` (`(E, I, H)`).

Invariants:
- The op is token-wise: each token's output reads that token's rows and
  the experts' weights only. So a token shard with every expert computes
  alone (`Shard(0)` over the tokens, weights Replicate), and a token shard
  with a shard of the experts computes with the other members of its line
  (EXPERTS: each row goes to the member holding its expert by an
  all-to-all, the per-expert counts exchanged first, and comes back;
  `runtime/expert_dispatch.py`). Which tokens a rank holds does not change
  any token's result.
- The arithmetic is transformers' own, in its order: rows sorted by expert
  (`torch.sort`), one `torch.mm` per expert of its consecutive rows, the
  gate's chunk then the up's, the weighted rows summed over the k choices
  in choice order. The backward recomputes an expert's forward on its rows
  and asks torch's autograd for the gradients (as flash attention
  recomputes its scores), so it saves the op's inputs only.
- `experts_forward` and `experts_backward` compute on rows already grouped
  by expert, `counts[e]` rows for the weights' expert e: the one place
  either kernel, local or expert-parallel, does an expert's arithmetic.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from meshplan.ir import Op, TensorMeta
from meshplan.ir.choices import KernelVariant
from meshplan.ir.kinds import ROUTED_EXPERTS, ROUTED_EXPERTS_BACKWARD
from meshplan.ir.sbp import Shard
from meshplan.ops.grad_util import tensor
from meshplan.ops.rule import Emits, Gouts, Grads, Needs
from meshplan.ops.sbp_sig import Outs, P, R, SbpSig, replicated, tensors

ROUTED = (ROUTED_EXPERTS, ROUTED_EXPERTS_BACKWARD)  # the op and its backward

# the activations a gated expert may apply, by the aten kind capture saw
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "aten.silu.default": torch.nn.functional.silu,
    "aten.gelu.default": torch.nn.functional.gelu,
    "aten.relu.default": torch.relu,
}


def _project(rows: Tensor, w: Tensor, counts: list[int], transposed: bool) -> Tensor:
    """Each expert's consecutive rows times its weight (transformers'
    grouped matmul: one `mm` per expert with rows)."""
    parts, start = [], 0
    for e, n in enumerate(counts):
        if n:
            we = w[e] if transposed else w[e].transpose(0, 1)
            parts.append(torch.mm(rows[start:start + n], we))
            start += n
    if not parts:
        out = w.shape[2] if transposed else w.shape[1]
        return rows.new_zeros(0, out)
    return torch.cat(parts)


def experts_forward(rows: Tensor, counts: list[int], w_in: Tensor, w_out: Tensor,
                    act: str, transposed: bool) -> Tensor:
    """The experts' outputs of `rows` grouped by expert (`counts[e]` rows
    for weight e): in, the activation of the gate's half times the up's,
    out."""
    h = _project(rows.to(w_in.dtype), w_in, counts, transposed)
    gate, up = h.chunk(2, dim=-1)
    return _project(ACTIVATIONS[act](gate) * up, w_out, counts, transposed)


def experts_backward(rows: Tensor, gates: Tensor, grads: Tensor, counts: list[int],
                     w_in: Tensor, w_out: Tensor, act: str, transposed: bool
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `sum(gates * experts_forward(rows) * grads)`: the rows',
    the gates', and the weights' (zero for an expert without rows), by
    recomputing the forward under torch's autograd."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (rows, gates, w_in, w_out)]
        x, g, wi, wo = leaves
        out = experts_forward(x, counts, wi, wo, act, transposed) * g.unsqueeze(-1)
        got = torch.autograd.grad(out, leaves, grads, allow_unused=True)
    gx, gg, gwi, gwo = (torch.zeros_like(t) if d is None else d for t, d in zip(leaves, got))
    return gx, gg, gwi, gwo


def sorted_rows(idx: Tensor, experts: int) -> tuple[Tensor, Tensor, list[int]]:
    """(the order of the (token, choice) rows sorted by expert, each row's
    token, the rows per expert): transformers' `sort` of the choices."""
    choices = idx.reshape(-1)
    _, perm = torch.sort(choices)
    counts = torch.bincount(choices, minlength=experts).tolist()
    return perm, perm // idx.shape[1], counts


def unsort_sum(rows: Tensor, perm: Tensor, tokens: int, k: int) -> Tensor:
    """Rows in the sorted order back to (token, choice), summed over the choices."""
    back = torch.empty_like(rows)
    back[perm] = rows
    return back.view(tokens, k, rows.shape[-1]).sum(dim=1)


def unsort_grads(gx_rows: Tensor, gg_rows: Tensor, perm: Tensor, token: Tensor,
                 x: Tensor, gates: Tensor) -> tuple[Tensor, Tensor]:
    """The tokens' gradient (each row's added into its token) and the
    gates' (each row's in its place)."""
    gx = torch.zeros_like(x).index_add_(0, token, gx_rows.to(x.dtype))
    gg = torch.empty(gates.numel(), dtype=gg_rows.dtype, device=gg_rows.device)
    gg[perm] = gg_rows
    return gx, gg.view(gates.shape).to(gates.dtype)


def routed_experts(x: Tensor, idx: Tensor, gates: Tensor, w_in: Tensor, w_out: Tensor, *,
                   act: str, transposed: bool) -> Tensor:
    """The op on a token shard holding every expert (see the module docstring)."""
    perm, token, counts = sorted_rows(idx, w_in.shape[0])
    y = experts_forward(x[token], counts, w_in, w_out, act, transposed)
    rows = y * gates.reshape(-1)[perm].unsqueeze(-1)
    return unsort_sum(rows, perm, *idx.shape).to(x.dtype)


def routed_experts_backward(x: Tensor, idx: Tensor, gates: Tensor, w_in: Tensor,
                            w_out: Tensor, grad: Tensor, *, act: str, transposed: bool
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dgates, dw_in, dw_out) on a token shard holding every expert."""
    perm, token, counts = sorted_rows(idx, w_in.shape[0])
    gx, gg, gwi, gwo = experts_backward(x[token], gates.reshape(-1)[perm], grad[token],
                                        counts, w_in, w_out, act, transposed)
    return (*unsort_grads(gx, gg, perm, token, x, gates), gwi, gwo)


# ------------------------------------------------------------------ the rule
def infer(a: tuple, kw: dict) -> tuple[TensorMeta, ...]:
    return (a[0],)


def infer_backward(a: tuple, kw: dict) -> tuple[TensorMeta, ...]:
    return a[0], a[2], a[3], a[4]


def grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    """Every gradient at once, by the backward op (none for the choices)."""
    (g,) = gouts
    assert g is not None
    x, idx, gates, w_in, w_out = (tensor(op, i) for i in range(5))
    outs = e.call_multi(ROUTED_EXPERTS_BACKWARD, x, idx, gates, w_in, w_out, g,
                        **dict(op.kwargs))
    return [(r, d) for r, d in zip((x, gates, w_in, w_out), outs) if needs(r)]


def flops(a: tuple) -> float:
    """Each (token, choice) row through one expert: 2 x its in and out weights."""
    x, idx, w_in, w_out = a[0], a[1], a[3], a[4]
    per_expert = (math.prod(w_in.shape) + math.prod(w_out.shape)) / w_in.shape[0]
    return 2.0 * math.prod(idx.shape) * per_expert * (1 if x.shape else 0)


def flops_backward(a: tuple) -> float:
    """The recomputed forward, and the two gradients of each matmul."""
    return 3.0 * flops(a)


def sbp(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """A token shard with every expert (the gradients of the weights partial
    sums in the backward); a token shard with a shard of the experts,
    routed over the axis (EXPERTS); or everything whole."""
    ts = tensors((args, kwargs))
    backward = len(outs) == 4
    tokens, experts = ts[0].shape[0], ts[3].shape[0]
    S0 = Shard(0)
    sigs = []
    if tokens >= n:
        if backward:
            sigs.append(SbpSig((S0, S0, S0, R, R, S0), (S0, S0, P, P)))
        else:
            sigs.append(SbpSig((S0, S0, S0, R, R), (S0,)))
        if experts % n == 0:
            sigs.append(SbpSig((S0,) * len(ts), (S0,) * len(outs), KernelVariant.EXPERTS))
    return sigs + [replicated(len(ts), len(outs))]
