"""SBP rules of matmuls, norms, attention, embedding, losses, convolution,
pooling and meshplan's own ops (one mesh axis; contract in `sbp_sig.py`).

The Megatron patterns come from these rows: a column-parallel linear is
`x R, w S(0), b S(0) -> S(-1)`; a row-parallel one is
`x S(-1), w S(1), b R -> P` (the bias added by one rank: BIAS_FIRST);
a vocab-parallel embedding is `w S(0), idx R -> P` (VOCAB_OFFSET).
"""

from __future__ import annotations

from meshplan.ir.choices import KernelVariant as KV
from meshplan.ir.sbp import Sbp, Shard
from meshplan.ops.sbp_sig import Outs, P, R, SbpSig, out_meta, replicated, same, tensors


def linear(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    ts = tensors((args, kwargs))
    x = ts[0]
    nb = len(x.shape)
    has_b = len(ts) == 3
    b = (R,) if has_b else ()
    sigs = [SbpSig((Shard(i), R) + b, (Shard(i),)) for i in range(nb - 1) if x.shape[i] > 1]
    sigs.append(SbpSig((R, Shard(0)) + ((Shard(0),) if has_b else ()), (Shard(nb - 1),)))
    first = KV.BIAS_FIRST if has_b else KV.NONE
    sigs.append(SbpSig((Shard(nb - 1), Shard(1)) + b, (P,), first))
    sigs.append(SbpSig((P, R) + b, (P,), first))
    return sigs + [replicated(len(ts), 1)]


def matmul(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """mm / bmm / matmul with broadcast batch dims (both operands >= 2-D)."""
    a, b = tensors((args, kwargs))[:2]
    if len(a.shape) < 2 or len(b.shape) < 2:
        return [replicated(2, 1)]
    out = out_meta(outs).shape
    nd = len(out)
    sigs = []
    for d in range(nd - 2):  # batch dims
        ja, jb = d - (nd - len(a.shape)), d - (nd - len(b.shape))
        sa = Shard(ja) if ja >= 0 and a.shape[ja] == out[d] else R
        sb = Shard(jb) if jb >= 0 and b.shape[jb] == out[d] else R
        if out[d] > 1:
            sigs.append(SbpSig((sa, sb), (Shard(d),)))
    la, lb = len(a.shape), len(b.shape)
    sigs += [
        SbpSig((Shard(la - 2), R), (Shard(nd - 2),)),
        SbpSig((R, Shard(lb - 1)), (Shard(nd - 1),)),
        SbpSig((Shard(la - 1), Shard(lb - 2)), (P,)),
        SbpSig((P, R), (P,)),
        SbpSig((R, P), (P,)),
    ]
    return sigs + [replicated(2, 1)]


def einsum(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """einsum(equation, operands): a letter of the output split on every
    operand holding it (whole on the others) splits the output; a letter
    summed away, split on every operand holding it, gives a Partial. A
    letter whose sizes differ (broadcast), a diagonal or an ellipsis: whole."""
    ts = tensors((args, kwargs))
    eq = args[0].replace(" ", "")
    if "..." in eq or "->" not in eq:
        return [replicated(len(ts), 1)]
    ins, out = eq.split("->")
    terms = ins.split(",")
    sigs = []
    for letter in dict.fromkeys(ins.replace(",", "")):
        sizes = {t.shape[term.index(letter)] for t, term in zip(ts, terms) if letter in term}
        if len(sizes) != 1 or sizes.pop() < 2 or any(term.count(letter) > 1 for term in terms):
            continue  # broadcast, a dim of 1, or a diagonal (a letter twice in one operand)
        layout = tuple(Shard(term.index(letter)) if letter in term else R for term in terms)
        sigs.append(SbpSig(layout, (Shard(out.index(letter)) if letter in out else P,)))
    return sigs + [replicated(len(ts), 1)]


def addmm(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    return [SbpSig((R, Shard(0), R), (Shard(0),)), replicated(3, 1)]


def layer_norm(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    ts = tensors((args, kwargs))
    x = ts[0]
    axis = len(x.shape) - len(args[1])
    k = len(ts) - 1
    sigs = [SbpSig((Shard(d),) + (R,) * k, (Shard(d),) * 3) for d in range(axis)
            if x.shape[d] > 1]
    return sigs + [replicated(len(ts), 3)]


def layer_norm_backward(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """(g, x, mean, rstd, w, b) -> (gx, gw, gb): a batch shard makes gw, gb Partial."""
    ts = tensors((args, kwargs))
    x = ts[1]
    axis = len(x.shape) - len(args[2])
    params = len(ts) - 4
    sigs = [SbpSig((Shard(d),) * 4 + (R,) * params,
                   (Shard(d),) + tuple(None if o is None else P for o in outs[1:]))
            for d in range(axis) if x.shape[d] > 1]
    return sigs + [SbpSig((R,) * len(ts), tuple(None if o is None else R for o in outs))]


def embedding(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    w, idx = tensors(args[:2])
    nd = len(idx.shape)
    sigs = [SbpSig((R, Shard(d)), (Shard(d),)) for d in range(nd) if idx.shape[d] > 1]
    sigs.append(SbpSig((Shard(1), R), (Shard(nd),)))
    sigs.append(SbpSig((Shard(0), R), (P,), KV.VOCAB_OFFSET))
    return sigs + [replicated(2, 1)]


def index_select(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """x.index_select(dim, idx): another dim's split passes through; the
    picked rows split as the indices are (each rank picks its own)."""
    x, idx = tensors(args)[:2]
    dim = args[1] % len(x.shape)
    sigs = [SbpSig((Shard(d), R), (Shard(d),)) for d in range(len(x.shape))
            if d != dim and x.shape[d] > 1]
    if idx.shape and idx.shape[0] > 1:
        sigs.append(SbpSig((R, Shard(0)), (Shard(dim),)))
    return sigs + [replicated(2, 1)]


def embedding_backward(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    g, idx = tensors(args[:2])
    nd = len(idx.shape)
    sigs = [SbpSig((Shard(d), Shard(d)), (P,)) for d in range(nd) if idx.shape[d] > 1]
    sigs.append(SbpSig((Shard(nd), R), (Shard(1),)))
    sigs.append(SbpSig((P, R), (P,)))
    # Each rank computing only its own vocab rows: for a vocab-sharded table.
    return sigs + [replicated(2, 1), SbpSig((R, R), (Shard(0),), KV.VOCAB_OFFSET)]


def nll_loss(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """(x[N, C], target[N], weight?) -> (loss, total_weight), reduction sum."""
    ts = tensors((args, kwargs))
    reduction = args[3]
    w = (R,) * (len(ts) - 2)
    sigs = []
    if reduction == 2 and len(ts[0].shape) == 2:
        sigs.append(SbpSig((Shard(0), Shard(0)) + w, (P, P)))
        if not w:  # class_offset's kernel is unweighted (`runtime/local_kernels.py`)
            sigs.append(SbpSig((Shard(1), R), (P, R), KV.CLASS_OFFSET))
    return sigs + [replicated(len(ts), 2)]


def nll_loss_backward(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """(g, x, target, weight?, total_weight) -> gx, reduction sum (whose kernel
    does not read total_weight, so it may be a Partial)."""
    ts = tensors((args, kwargs))
    reduction = args[4]
    k = len(ts) - 3
    sigs = []
    if reduction == 2 and len(ts[1].shape) == 2:
        sigs.append(SbpSig((R, Shard(0), Shard(0)) + (R,) * k, (Shard(0),)))
        # A sum's backward never reads total_weight (only a mean divides by it).
        sigs.append(SbpSig((R, Shard(0), Shard(0)) + (R,) * (k - 1) + (P,), (Shard(0),)))
        if k == 1:  # no weight: class_offset's kernel is unweighted
            sigs.append(SbpSig((R, Shard(1), R, R), (Shard(1),), KV.CLASS_OFFSET))
    return sigs + [replicated(len(ts), 1)]


def attention(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """Flash attention and its backward: batch or head shards pass through;
    and queries split by sequence against whole keys and values (context
    parallelism's all-gather form: each rank's rows of the output, its keys'
    and values' gradients partial sums), causal through CAUSAL_OFFSET (the
    mask at the queries' own positions); or every tensor split by sequence,
    the keys and values passed around the axis's ring inside the kernel
    (RING: `runtime/ring_attention.py`)."""
    ts = tensors((args, kwargs))
    q = ts[0] if len(ts[0].shape) == 4 else ts[1]
    sigs = [same(len(ts), len(outs), Shard(d)) for d in (0, 1) if q.shape[d] > 1]
    backward = len(outs) == 3  # (grad_out, q, k, v, out, lse) -> (dq, dk, dv)
    k = ts[2] if backward else ts[1]
    if q.shape[2] > 1 and k.shape[2] == q.shape[2]:
        causal = args[7] if backward else (args[4] if len(args) > 4 else False)
        kv = KV.CAUSAL_OFFSET if causal else KV.NONE
        seq = Shard(2)
        sigs.append(SbpSig((seq, seq, R, R, seq, seq), (seq, P, P), kv) if backward else
                    SbpSig((seq, R, R), (seq, seq), kv))
        if q.shape[2] % n == 0:  # the ring passes equal blocks
            sigs.append(SbpSig((seq,) * len(ts), (seq,) * len(outs), KV.RING))
    return sigs + [replicated(len(ts), len(outs))]


def masked_attention(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """`scaled_dot_product_attention` with a mask (BART's, T5's position
    bias): a batch or head shard of q, k, v and the output, with the mask
    split alike where it has that dim, broadcast where it broadcasts; or
    the queries split by sequence against whole keys and values (context
    parallelism's all-gather form), the mask's rows split with them."""
    ts = tensors((args, kwargs))
    q, k = ts[0], ts[1]
    sigs = []
    for d in (0, 1):
        if q.shape[d] == 1 or k.shape[d] != q.shape[d]:  # grouped-query heads: batch only
            continue
        mask = []
        for m in ts[3:]:
            md = d - (len(q.shape) - len(m.shape))  # the mask broadcasts from the right
            mask.append(Shard(md) if md >= 0 and m.shape[md] == q.shape[d] else R)
        sigs.append(SbpSig((Shard(d),) * 3 + tuple(mask), (Shard(d),)))
    causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
    if q.shape[2] > 1 and k.shape[2] == q.shape[2] and not causal:
        # queries split by sequence, keys and values whole: the mask's rows
        # (its dim -2, where it has them) split alike, so it holds the positions
        rows = [Shard(len(m.shape) - 2) if len(m.shape) >= 2 and m.shape[-2] == q.shape[2]
                else R for m in ts[3:]]
        sigs.append(SbpSig((Shard(2), R, R) + tuple(rows), (Shard(2),)))
    return sigs + [replicated(len(ts), len(outs))]


def conv2d(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    ts = tensors((args, kwargs))
    has_b = len(ts) == 3
    groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
    b = (R,) if has_b else ()
    sigs = [SbpSig((Shard(0), R) + b, (Shard(0),))]
    if groups == 1:
        sigs.append(SbpSig((R, Shard(0)) + ((Shard(0),) if has_b else ()), (Shard(1),)))
        sigs.append(SbpSig((Shard(1), Shard(1)) + b, (P,), KV.BIAS_FIRST if has_b else KV.NONE))
    return sigs + [replicated(len(ts), 1)]


def conv2d_backward(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """(g, x, w) -> (gx, gw, gb): a batch shard makes the weight grads Partial."""
    ts = tensors((args, kwargs))
    layouts: tuple[Sbp, ...] = (Shard(0), P, P)
    sig_outs = tuple(None if o is None else s for o, s in zip(outs, layouts))
    return [SbpSig((Shard(0), Shard(0), R), sig_outs),
            SbpSig((R,) * len(ts), tuple(None if o is None else R for o in outs))]


def batch_passthrough(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """Pooling and friends (and their backward): batch and channel shards pass."""
    ts = tensors((args, kwargs))
    sigs = [same(len(ts), len(outs), Shard(d)) for d in (0, 1) if ts[0].shape[d] > 1]
    return sigs + [replicated(len(ts), len(outs))]


def grad_sum(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    ts = tensors((args, kwargs))
    nd = len(ts[0].shape)
    sigs = [same(len(ts), 1, Shard(d)) for d in range(nd) if ts[0].shape[d] > 1]
    return sigs + [same(len(ts), 1, P), replicated(len(ts), 1)]


def accumulate(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """accumulate_grad(acc, g): the accumulator keeps g's layout, Partial included."""
    return grad_sum(args, kwargs, outs, n)


def optimizer(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """sgd / adamw: every tensor in the parameter's layout (never Partial);
    AdamW's scalar step counter is replicated."""
    ts = tensors((args, kwargs))
    p = ts[0]
    per = [R if t.shape != p.shape else None for t in ts]
    sigs = []
    for d in range(len(p.shape)):
        if p.shape[d] > 1:
            ins = tuple(s or Shard(d) for s in per)
            sigs.append(SbpSig(ins, tuple(ins[i] for i in _out_positions(len(outs)))))
    return sigs + [replicated(len(ts), len(outs))]


def grad_sq(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """grad_sq(param, grad, *slots): the optimizer's own signatures (it reads
    the optimizer's tensors, so it gets the same gradient layout), giving a
    Partial sum of squares: a split gradient's pieces add up; a replicated
    one is counted by the axis's first rank only (REPLICA_FIRST)."""
    return [SbpSig(sig.ins, (P,), KV.NONE if isinstance(sig.ins[1], Shard)
                   else KV.REPLICA_FIRST)
            for sig in optimizer(args, kwargs, (None,) * 2, n)] + \
        [replicated(len(tensors((args, kwargs))), 1)]


def sq_sum(args: tuple, kwargs: dict, outs: Outs, n: int) -> list[SbpSig]:
    """A sum of squared norms: Partial in, Partial out (or all Replicate)."""
    k = len(tensors((args, kwargs)))
    return [same(k, 1, P), replicated(k, 1)]


def _out_positions(n_out: int) -> tuple[int, ...]:
    """Input positions of each optimizer output: (param, then the state slots)."""
    return (0,) + tuple(range(2, 1 + n_out))
