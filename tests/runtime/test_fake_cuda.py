"""CUDA plans run a whole training step on fake CUDA tensors: every kernel
(the CUDA attention adapters included) is checked by its meta kernel for
device, dtype and signature, with no GPU (FakeTensorMode works on a CPU-only
torch). What it cannot check: numbers, and ops that read values on the host
(AdamW's step count, fp16's overflow flag), so the optimizer here is SGD."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.mesh import Mesh
from meshplan.lowering.lower import lower
from meshplan.models import build_model, example_batch, model_config
from meshplan.ops import device_kernels as dk
from meshplan.runtime.data import split_microbatches
from meshplan.runtime.live_bytes import LiveBytes
from meshplan.runtime.rank_executor import RankExecutor
from meshplan.runtime.state import weights_of

CASES = [("gpt", "fp32", False), ("gpt", "bf16", False), ("gpt", "bf16", True),
         pytest.param("bert", "bf16", False, marks=pytest.mark.slow),
         pytest.param("resnet", "fp32", False, marks=pytest.mark.slow)]
ATTENTION_RAN = {("gpt", "fp32", False): {dk.EFFICIENT, dk.EFFICIENT_BACKWARD},
                 ("gpt", "bf16", False): {dk.FLASH, dk.FLASH_BACKWARD},
                 ("gpt", "bf16", True): {dk.CUDNN, dk.CUDNN_BACKWARD}}


@pytest.mark.parametrize("model,precision,cudnn", CASES)
def test_cuda_plan_steps_on_fake_cuda_tensors(model, precision, cudnn, monkeypatch):
    """`cudnn`: as on an H100/H200, where eager's dispatcher prefers cuDNN
    attention, the flash adapters run cuDNN's kernels (their meta kernels check
    the calls: arguments, logsumexp shape, the backward's sequence offsets)."""
    if cudnn:
        monkeypatch.setattr(dk, "_eager_runs_cudnn", lambda *a: True)
    monkeypatch.setattr(LiveBytes, "add", lambda self, t: None)  # fake tensors have no
    monkeypatch.setattr(LiveBytes, "drop", lambda self, t: None)  # storage pointers
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    cfg = model_config(model, "tiny")
    strategy = zoo_strategy(model, cfg, global_batch_size=4, micro_batch_size=2,
                            precision=precision)
    job = plan_model(model, "tiny", Mesh(1, 1), strategy, "sgd").job
    plan = lower(job, 0, "cuda")
    shapes = weights_of(build_model(cfg, device="meta"))
    batch = example_batch(cfg, 4)
    dk.FALLBACKS.clear()
    dk.RAN.clear()
    with FakeTensorMode() as mode:
        weights = {k: torch.empty(t.shape, dtype=t.dtype, device="cuda:0")
                   for k, t in shapes.items()}
        ex = RankExecutor(job, plan, None, device="cuda:0")
        state = ex.init_state(weights)
        fake_batch = tuple(mode.from_tensor(t) for t in batch)
        for _ in range(2):  # the second step reads the first one's optimizer state
            losses = ex.step(state, split_microbatches(fake_batch, 2))
    assert len(losses) == 2 and all(x.device.type == "cuda" for x in losses)
    assert all(t.device.type == "cuda" for t in state.values() if t is not None)
    assert dk.FALLBACKS == {}  # the fused kernels accepted their (fake) inputs
    want = ATTENTION_RAN.get((model, precision, cudnn))
    if want:
        assert set(dk.RAN) == want, dk.RAN
