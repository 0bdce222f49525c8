"""Per-op policies of the training-step passes, as tables.

- `PRECISION`: under mixed precision, `LOW` kinds compute in bf16/fp16 (every
  float input cast down) and `FP32` kinds in fp32 (low inputs cast back);
  the lists are CUDA autocast's. Kinds not listed follow type promotion.
- `RECOMPUTE`: under selective activation checkpointing, `KEEP` kinds (costly
  to redo: matmuls, attention, convolution) keep their outputs. A random op
  is meshplan's own, which replays (capture refuses any other draw,
  `random_ops.draws`).

`table.rule_for` copies these into each `OpRule` (`precision`, `recompute`),
as `ir/choices` members (`OpPrecision`, `OpRecompute`).
"""

from __future__ import annotations

from meshplan.ir.choices import OpPrecision, OpRecompute

_LOW = (
    "aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten.matmul.default", "aten.baddbmm.default", "aten.conv1d.default",
    "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default",
    "aten.scaled_dot_product_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
)
_FP32 = (
    "aten.native_layer_norm.default", "aten.layer_norm.default",
    "aten.group_norm.default", "aten.native_group_norm.default",
    "aten._native_batch_norm_legit_functional.default", "aten.batch_norm.default",
    "aten._softmax.default", "aten.softmax.int", "aten._log_softmax.default",
    "aten.log_softmax.int", "aten.nll_loss_forward.default", "aten.nll_loss.default",
    "aten.cross_entropy_loss.default", "aten.mse_loss.default",
    "aten.binary_cross_entropy_with_logits.default", "aten.sum.default",
    "aten.sum.dim_IntList", "aten.mean.default", "aten.mean.dim", "aten.logsumexp.default",
    "aten.cumsum.default", "aten.exp.default", "aten.log.default", "aten.pow.Tensor_Scalar",
    "aten.rsqrt.default", "aten.var.correction", "aten.var_mean.correction",
    "aten.norm.ScalarOpt_dim", "aten.linalg_vector_norm.default", "aten.cdist.default",
    *(f"aten.fft_{k}.default" for k in (  # no FFT kernel takes bf16 (FNet's mixing)
        "fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2",
        "rfftn", "irfftn", "hfft", "ihfft")),
    # not autocast's: complex numbers have no bf16 (DeepSeek-V2's rotary casts
    # to fp32 before it; a graph captured in fp32 holds no such cast)
    "aten.view_as_complex.default",
)
# not listed by autocast, but computed as its bmm, which is; a capture under
# autocast records it whole, in fp32 (PEGASUS-X)
_LOW_INSIDE = ("aten.einsum.default",)
PRECISION: dict[str, OpPrecision] = ({k: OpPrecision.LOW for k in _LOW}
                                     | {k: OpPrecision.LOW_INSIDE for k in _LOW_INSIDE}
                                     | {k: OpPrecision.FP32 for k in _FP32})

# The expensive kinds are exactly those that compute in low precision.
RECOMPUTE: dict[str, OpRecompute] = {k: OpRecompute.KEEP for k in (*_LOW, *_LOW_INSIDE)}


def recompute_class(kind: str) -> OpRecompute:
    """What selective recompute does with an aten kind."""
    return RECOMPUTE.get(kind, OpRecompute.FREE)
