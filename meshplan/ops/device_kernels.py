"""Kernels chosen per device type: the physical kernel a logical op runs as.

The Job is device-independent: its ops are the canonical (logical) kinds
capture wrote, e.g. attention as `_scaled_dot_product_flash_attention_for_cpu`
and its backward. Lowering for a device type asks the op's rule
(`OpRule.devices`) which physical kernel this rank runs; the name goes into
the task (`Task.kernel`, "" = the logical kind itself), and binding turns it
into a callable with the *logical* op's arguments and outputs (`adapter`).

Invariants:
- A chooser is a pure function of the op and the Job's value metas (dtype,
  shapes, literals), so every rank of a stage picks the same kernel, and a
  forward and its backward agree (both see the same q, k, v metas).
- An adapter keeps the logical signature: the attention forward returns
  `(out, logsumexp)`, the backward takes `(grad, q, k, v, out, lse, dropout_p,
  is_causal, *, attn_mask, scale)` and returns `(gq, gk, gv)`. The extra
  outputs of the CUDA kernels (rng state, sequence offsets) are not needed
  without dropout, which is the only case chosen here.
- An adapter may also stand in for a logical op the device's own kernel
  refuses (`histc` of integers on the CPU).
- No kernel whose name contains `_for_cpu` is ever chosen for cuda
  (`tests/lowering/test_device_lowering.py` proves it over the zoo).

[Note: which CUDA attention kernel] Eager PyTorch dispatches
`scaled_dot_product_attention` on CUDA to flash (fp16/bf16, head_dim a
multiple of 8 up to 256, no mask, no dropout here), else memory-efficient
(fp32 too; head_dim a multiple of 16 bytes), else math. A mask given at run
time (a rank's causal rows under context parallelism, `CAUSAL_OFFSET`) sends
the flash adapters to the efficient kernel, which takes one: flash and
cuDNN here take none, and ignoring it would be a silent wrong answer. The choosers below
follow the same order, so meshplan runs the kernel eager runs and `verify`
compares like with like. Where eager's dispatcher prefers cuDNN attention
(torch 2.10 and later on sm90/sm100 with a recent cuDNN: the H100 and H200),
the flash adapters run cuDNN's kernels instead, on the same inputs, because
eager does: the choice between them is asked of torch's own dispatcher
(`torch._fused_sdp_choice`) on the device at run time, since a plan lowered
on a CPU cannot know the card or its cuDNN. The forward and its backward ask
the same question of the same q, k, v, so they agree; both kernels share the
logical signature (cuDNN's logsumexp is (B, H, S, 1), flash's (B, H, S): the
same bytes). `RAN` counts the physical kernels that ran. A fused kernel that
still refuses an input at run time falls back to the math path (counted in
`FALLBACKS`, reported by the runtime), never to a wrong answer: a forward
fallback leaves an empty logsumexp, which sends its backward to the math
path too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import Tensor

from meshplan.errors import PlanError
from meshplan.ir import Op, Ref, Value

Values = Mapping[int, Value]  # the Job's values by id
Grads3 = tuple[Tensor, ...]  # (gq, gk, gv)
Chooser = Callable[[Op, Values], str]  # (op, values) -> physical kernel name

SDPA_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SDPA_CPU_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
FLASH = "aten._scaled_dot_product_flash_attention.default"
FLASH_BACKWARD = "aten._scaled_dot_product_flash_attention_backward.default"
EFFICIENT = "aten._scaled_dot_product_efficient_attention.default"
EFFICIENT_BACKWARD = "aten._scaled_dot_product_efficient_attention_backward.default"
CUDNN = "aten._scaled_dot_product_cudnn_attention.default"
CUDNN_BACKWARD = "aten._scaled_dot_product_cudnn_attention_backward.default"
MATH = "meshplan.sdpa_math"
MATH_BACKWARD = "meshplan.sdpa_math_backward"
HISTC = "aten.histc.default"
HISTC_OF_FLOATS = "meshplan.histc_of_floats"

FALLBACKS: dict[str, int] = {}  # physical kernel -> runs that fell back to math
RAN: dict[str, int] = {}  # physical attention kernel -> runs (cuDNN where it stood in for flash)
# The rng-state tensors a fused forward returned, by (kernel, device): without
# dropout their values are never read, but the backward takes tensors of the
# very types the forward made, so it gets those (eager's autograd does the same).
_RNG: dict = {}


def _arg(op: Op, i: int, name: str, default: Any = None) -> Any:
    if len(op.args) > i:
        return op.args[i]
    return dict(op.kwargs).get(name, default)


def _attention_kind(op: Op, values: Values, q_pos: int, dropout_pos: int) -> str:
    """flash, efficient or math, for the q meta at `q_pos` (see the Note)."""
    q_ref = op.args[q_pos]
    assert isinstance(q_ref, Ref), f"argument {q_pos} of {op.kind} is not a tensor"
    q = values[q_ref.id].meta
    head_dim = q.shape[-1]
    # Capture makes attention with dropout aten ops and a `meshplan.dropout`
    # (ops/random_ops.py), whose mask is the same at any layout.
    assert not _arg(op, dropout_pos, "dropout_p", 0.0), "attention dropout survived capture"
    if dict(op.kwargs).get("attn_mask") is not None:
        return "math"
    low = q.dtype.name in ("bfloat16", "float16")
    if low and head_dim % 8 == 0 and head_dim <= 256:
        return "flash"
    if head_dim % (8 if low else 4) == 0:
        return "efficient"
    return "math"


def cuda_sdpa(op: Op, values: Values) -> str:
    """The CUDA kernel of the attention forward `op`."""
    kind = _attention_kind(op, values, 0, 3)
    return {"flash": FLASH, "efficient": EFFICIENT, "math": MATH}[kind]


def cuda_sdpa_backward(op: Op, values: Values) -> str:
    """The CUDA kernel of the attention backward `op` (same choice as its forward)."""
    kind = _attention_kind(op, values, 1, 6)
    return {"flash": FLASH_BACKWARD, "efficient": EFFICIENT_BACKWARD,
            "math": MATH_BACKWARD}[kind]


# ---------------------------------------------------------------- adapters
def _math_forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                 is_causal: bool = False, *, attn_mask: Tensor | None = None,
                 scale: float | None = None) -> tuple[Tensor, Tensor]:
    out, _ = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale)
    return out, q.new_empty((0,), dtype=torch.float32)  # empty lse: "no saved statistics"


def _math_backward(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   dropout_p: float, is_causal: bool, *, attn_mask: Tensor | None = None,
                   scale: float | None = None) -> Grads3:
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        o, _ = torch.ops.aten._scaled_dot_product_attention_math(
            qq, kk, vv, attn_mask, dropout_p, is_causal, scale=scale)
        return torch.autograd.grad(o, (qq, kk, vv), g)


def _fallback(name: str, err: RuntimeError) -> None:
    FALLBACKS[name] = FALLBACKS.get(name, 0) + 1
    if FALLBACKS[name] == 1:
        logging.getLogger("meshplan").warning("%s refused its input (%s); using the math "
                                              "attention", name, str(err).splitlines()[0])


def _ran(name: str) -> None:
    RAN[name] = RAN.get(name, 0) + 1


_CUDNN_BACKEND = torch.nn.attention.SDPBackend.CUDNN_ATTENTION.value


def _eager_runs_cudnn(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, is_causal: bool,
                      scale: float | None) -> bool:
    """Whether eager's SDPA would run cuDNN attention on these inputs (see the
    Note); never without a CUDA device (fake CUDA tensors on a CPU-only torch)."""
    return q.is_cuda and torch.cuda.is_available() and torch._fused_sdp_choice(
        q, k, v, None, dropout_p, is_causal, scale=scale) == _CUDNN_BACKEND


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                  is_causal: bool = False, *, attn_mask: Tensor | None = None,
                  scale: float | None = None) -> tuple[Tensor, Tensor]:
    if attn_mask is not None:  # a rank's causal rows (CAUSAL_OFFSET): flash takes no mask
        return _efficient_forward(q, k, v, dropout_p, is_causal, attn_mask=attn_mask,
                                  scale=scale)
    name = CUDNN if _eager_runs_cudnn(q, k, v, dropout_p, is_causal, scale) else FLASH
    try:
        if name == CUDNN:
            r = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, dropout_p, is_causal, False, scale=scale)
            _RNG[CUDNN, q.device] = (r[6], r[7], r[2], r[3])
        else:
            r = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale)
            _RNG[FLASH, q.device] = (r[6], r[7])
    except RuntimeError as err:
        _fallback(name, err)
        return _math_forward(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    _ran(name)
    return r[0], r[1]


def _flash_backward(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    dropout_p: float, is_causal: bool, *, attn_mask: Tensor | None = None,
                    scale: float | None = None) -> Grads3:
    if attn_mask is not None:  # its forward ran the efficient kernel (above)
        return _efficient_backward(g, q, k, v, out, lse, dropout_p, is_causal,
                                   attn_mask=attn_mask, scale=scale)
    if lse.numel() == 0:  # the forward fell back
        return _math_backward(g, q, k, v, out, lse, dropout_p, is_causal, scale=scale)
    cudnn = _eager_runs_cudnn(q, k, v, dropout_p, is_causal, scale)
    name = CUDNN_BACKWARD if cudnn else FLASH_BACKWARD
    try:
        if cudnn:
            seed, offset, cum_q, cum_k = _rng_of(CUDNN, q.device, 4)
            got = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                g, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, q.shape[-2],
                k.shape[-2], dropout_p, is_causal, scale=scale)
        else:
            seed, offset = _rng_of(FLASH, q.device, 2)
            got = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                g, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], dropout_p,
                is_causal, seed, offset, scale=scale)
    except RuntimeError as err:
        _fallback(name, err)
        return _math_backward(g, q, k, v, out, lse, dropout_p, is_causal, scale=scale)
    _ran(name)
    return got


def _rng_of(forward: str, device: torch.device, n: int) -> tuple[Tensor, ...]:
    """The `n` rng-state (and, for cuDNN, sequence-offset) tensors for a
    backward (see `_RNG`); empty ones when the forward ran in another process
    (a recomputed or received value)."""
    got = _RNG.get((forward, device))
    if got is None:
        return (torch.empty((0,), dtype=torch.int64, device=device),) * n
    return got


def _bias(attn_mask: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    """A mask as the efficient kernel takes it (SDPA's own preprocessing): its
    rows padded to 16 elements, then viewed at (batch, heads, Lq, Lk)."""
    if attn_mask is None:
        return None
    lk = k.shape[-2]
    if lk % 16:
        attn_mask = torch.nn.functional.pad(attn_mask, (0, -lk % 16))[..., :lk]
    return attn_mask.expand(q.shape[0], q.shape[1], q.shape[-2], lk)


def _efficient_forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                      is_causal: bool = False, *, attn_mask: Tensor | None = None,
                      scale: float | None = None) -> tuple[Tensor, Tensor]:
    try:
        r = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, _bias(attn_mask, q, k), True, dropout_p, is_causal, scale=scale)
    except RuntimeError as err:
        _fallback(EFFICIENT, err)
        return _math_forward(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    _RNG[EFFICIENT, q.device] = (r[2], r[3])
    _ran(EFFICIENT)
    return r[0], r[1]


def _efficient_backward(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        dropout_p: float, is_causal: bool, *, attn_mask: Tensor | None = None,
                        scale: float | None = None) -> Grads3:
    if lse.numel() == 0:
        return _math_backward(g, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask,
                              scale=scale)
    seed, offset = _rng_of(EFFICIENT, q.device, 2)
    try:
        gq, gk, gv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, _bias(attn_mask, q, k), out, lse, seed, offset, dropout_p,
            [True, True, True, False], is_causal, scale=scale)
    except RuntimeError as err:
        _fallback(EFFICIENT_BACKWARD, err)
        return _math_backward(g, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask,
                              scale=scale)
    _ran(EFFICIENT_BACKWARD)
    return gq, gk, gv


def cpu_histc(op: Op, values: Values) -> str:
    """torch's CPU `histc` counts floating values only (CUDA's, integers too):
    a graph captured off the CPU (on meta, as transformers' MoE routing
    branches on the device) may count integers; on the CPU they are counted
    as floats, exact for values below 2**24."""
    x = op.args[0]
    assert isinstance(x, Ref), f"argument 0 of {op.kind} is not a tensor"
    return "" if values[x.id].meta.dtype.torch.is_floating_point else HISTC_OF_FLOATS


def _histc_of_floats(x: Tensor, bins: int = 100, min: float = 0, max: float = 0) -> Tensor:
    return torch.histc(x.float(), bins, min, max).to(x.dtype)


_ADAPTERS: dict[str, Callable] = {
    HISTC_OF_FLOATS: _histc_of_floats,
    FLASH: _flash_forward, FLASH_BACKWARD: _flash_backward,
    EFFICIENT: _efficient_forward, EFFICIENT_BACKWARD: _efficient_backward,
    MATH: _math_forward, MATH_BACKWARD: _math_backward,
}


def adapter(name: str) -> Callable:
    """The callable running physical kernel `name` with its logical op's signature."""
    fn = _ADAPTERS.get(name)
    if fn is None:
        raise PlanError(f"the plan names kernel {name!r}, which this meshplan does not know; "
                        "recompile the plans with this version")
    return fn


# logical kind -> ((device type, chooser(op, values) -> physical kernel name), ...)
DEVICES: dict[str, tuple[tuple[str, Chooser], ...]] = {
    SDPA_CPU: (("cuda", cuda_sdpa),),
    SDPA_CPU_BACKWARD: (("cuda", cuda_sdpa_backward),),
    HISTC: (("cpu", cpu_histc),),
}
