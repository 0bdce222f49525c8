"""Capture-time rewrites into the canonical op forms the rule table knows.

Each rewrite takes `(e, args, kwargs, ctx)` and returns the Refs standing for
the captured node's outputs. No rewrite handles mutation: torch's own
functionalization has removed it before capture translates a node
([Note: mutation] in `capture/export.py`).

Why rewrite: gradients need the saved statistics that only the `native_*`
forms return (mean/rstd of a norm, indices of a max-pool, logsumexp of
attention).
"""

from __future__ import annotations

from typing import Any

import torch

from meshplan.errors import CaptureError
from meshplan.ir import Ref
from meshplan.ops import random_ops
from meshplan.ops.rule import CanonicalFn, Emits


def _first(refs: tuple[Ref, ...]) -> tuple[Ref]:
    return (refs[0],)


def layer_norm(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    x, shape = args[0], args[1]
    w = args[2] if len(args) > 2 else kw.get("weight")
    b = args[3] if len(args) > 3 else kw.get("bias")
    eps = args[4] if len(args) > 4 else kw.get("eps", 1e-5)
    return _first(e.call_multi("aten.native_layer_norm.default", x, shape, w, b, eps))


def softmax(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    return (e.call("aten._softmax.default", args[0], args[1], False),)


def log_softmax(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    return (e.call("aten._log_softmax.default", args[0], args[1], False),)


def cross_entropy(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    x, target = args[0], args[1]
    rest = dict(zip(("weight", "reduction", "ignore_index", "label_smoothing"), args[2:]))
    rest.update(kw)
    smoothing = rest.get("label_smoothing", 0.0)
    if len(e.meta(x).shape) > 2 or smoothing != 0.0:
        return (e.call("aten.cross_entropy_loss.default", *args, **kw),)
    dim = 1 if len(e.meta(x).shape) == 2 else 0
    logp = e.call("aten._log_softmax.default", x, dim, False)
    reduction = rest.get("reduction", 1)
    # A mean is kept as sum / total weight: both are sums over samples, so a
    # batch split makes them Partial and one scalar all-reduce each finishes
    # the global mean (the division itself happens replicated).
    loss, total = e.call_multi(
        "aten.nll_loss_forward.default", logp, target, rest.get("weight"),
        2 if reduction == 1 else reduction, rest.get("ignore_index", -100),
    )
    if reduction == 1:
        if rest.get("weight") is None:  # the count of targets, from the targets alone: its
            kept = e.call("aten.ne.Scalar", target, rest.get("ignore_index", -100))  # sum
            total = e.call("aten.sum.default", kept, dtype=e.meta(logp).dtype)  # over dp can
        loss = e.call("aten.div.Tensor", loss, total)  # start before the logits are made
    return (loss,)


def dropout(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    x = args[0]
    p = args[1] if len(args) > 1 else kw.get("p", 0.5)
    train = args[2] if len(args) > 2 else kw.get("train", True)
    if p == 0 or not train:
        return (x,)  # no op at all: dropout off is the identity
    return _first(random_ops.dropout(e, x, p, ctx))


def sdpa(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    opts = dict(zip(names, args[3:]))
    opts.update(kw)
    if opts.get("dropout_p", 0.0):  # with our mask: the same at any layout
        return (random_ops.attention(e, args[0], args[1], args[2], opts, ctx),)
    if opts.get("attn_mask") is not None or opts.get("enable_gqa", False):
        return (e.call("aten.scaled_dot_product_attention.default", *args, **kw),)
    out = e.call_multi(
        "aten._scaled_dot_product_flash_attention_for_cpu.default", *args[:3],
        opts.get("dropout_p", 0.0), opts.get("is_causal", False), scale=opts.get("scale"),
    )
    return _first(out)


def elementwise_loss(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    """mse_loss(x, y, reduction) as the loss of each element (reduction 0),
    then its sum or mean: a split batch sums to a Partial, where the whole
    loss would need every element gathered. Still one `mse_loss`, so its
    precision is the loss's (fp32 under autocast)."""
    reduction = args[2] if len(args) > 2 else kw.get("reduction", 1)
    each = e.call("aten.mse_loss.default", args[0], args[1], 0)
    if reduction == 0:
        return (each,)
    return (e.call("aten.mean.default" if reduction == 1 else "aten.sum.default", each),)


def cast(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    """`type_as`, `to(other)`, `to(device, dtype)`, `to(dtype=...)`: a cast
    to the dtype they name (`_to_copy`, whose rule splits as its input and
    passes a Partial), or the input itself when it has that dtype already.
    The device is the rank's (capture writes every device as it), and a
    `type_as`'s other tensor gives only its dtype, so it is no input. The IR
    carries no memory formats (as `clone`): channels_last is one line."""
    x = args[0]
    if any(isinstance(a, str) and "channels_last" in a for a in (*args, *kw.values())):
        raise CaptureError("a cast to memory format channels_last is not supported; keep "
                           "the default layout in the model")
    dtype: Any
    if len(args) > 1 and isinstance(args[1], Ref):  # type_as, to.other
        dtype = e.meta(args[1]).dtype
    else:  # to.device's dtype is positional, to.dtype_layout's a keyword
        dtype = args[2] if len(args) > 2 else kw.get("dtype")
    if dtype is None or dtype == e.meta(x).dtype:
        return (x,)
    return (e.call("aten._to_copy.default", x, dtype=dtype),)


def max_pool2d(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    return _first(e.call_multi("aten.max_pool2d_with_indices.default", *args, **kw))


def adaptive_avg_pool2d(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    return (e.call("aten._adaptive_avg_pool2d.default", *args, **kw),)


def clone(e: Emits, args: tuple, kw: dict, ctx: Any) -> tuple[Ref, ...]:
    """`clone(x, memory_format=contiguous_format)`, functionalization's form of
    `x.contiguous()`, is `contiguous` again: the IR carries no memory formats,
    and the views after it need the contiguous strides."""
    fmt = kw.pop("memory_format", None)
    if fmt == str(torch.contiguous_format):
        return (e.call("aten.contiguous.default", args[0]),)
    if fmt not in (None, str(torch.preserve_format)):
        raise CaptureError(f"clone to memory format {fmt} is not supported; keep the "
                           "default layout (no channels_last) in the model")
    return (e.call("aten.clone.default", *args, **kw),)


CANONICAL: dict[str, CanonicalFn] = {
    "aten.clone.default": clone,
    "aten.mse_loss.default": elementwise_loss,
    **dict.fromkeys(("aten.type_as.default", "aten.to.other", "aten.to.device",
                     "aten.to.dtype_layout"), cast),
    "aten.layer_norm.default": layer_norm,
    "aten.softmax.int": softmax,
    "aten.log_softmax.int": log_softmax,
    "aten.cross_entropy_loss.default": cross_entropy,
    "aten.dropout.default": dropout,
    "aten.scaled_dot_product_attention.default": sdpa,
    "aten.max_pool2d.default": max_pool2d,
    **random_ops.CANONICAL,
    "aten.adaptive_avg_pool2d.default": adaptive_avg_pool2d,
}
