"""The GPU path, on a real CUDA device (skipped without one; run by
`benchmarks/gpu_check.py` as `pytest -m cuda`). Each test is small: the whole
file takes well under a minute on one GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshplan.ops import device_kernels as dk

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype,forward,backward", [
    (torch.bfloat16, dk.FLASH, dk.FLASH_BACKWARD),
    (torch.float32, dk.EFFICIENT, dk.EFFICIENT_BACKWARD),
    (torch.bfloat16, dk.EFFICIENT, dk.EFFICIENT_BACKWARD),
    (torch.float32, dk.MATH, dk.MATH_BACKWARD),
])
def test_cuda_attention_adapters_match_eager(dtype, forward, backward):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    g = torch.randn(2, 4, 64, 32, device="cuda", dtype=dtype)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    dk.FALLBACKS.clear()
    dk.RAN.clear()
    with torch.no_grad():
        out, lse = dk.adapter(forward)(q, k, v, 0.0, True, scale=None)
        grads = dk.adapter(backward)(g, q, k, v, out, lse, 0.0, True, attn_mask=None,
                                     scale=None)
    assert dk.FALLBACKS == {}, "a fused kernel refused its input"
    if forward == dk.FLASH:  # the kernel eager runs here: cuDNN's where it prefers that
        eager_cudnn = torch._fused_sdp_choice(q, k, v, None, 0.0, True) == \
            torch.nn.attention.SDPBackend.CUDNN_ATTENTION.value
        want = {dk.CUDNN, dk.CUDNN_BACKWARD} if eager_cudnn else {forward, backward}
        assert set(dk.RAN) == want, dk.RAN
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype,forward,backward", [
    (torch.bfloat16, dk.FLASH, dk.FLASH_BACKWARD),
    (torch.float32, dk.EFFICIENT, dk.EFFICIENT_BACKWARD),
])
def test_cuda_attention_adapters_honour_a_causal_offset_mask(dtype, forward, backward):
    """A cp rank's rows (positions 16..31 and 48..63 of 64, zigzag) against
    every key: the adapters with CAUSAL_OFFSET's mask equal those rows of
    eager's whole causal attention (flash takes no mask: it must not be
    dropped)."""
    from meshplan.runtime.local_kernels import causal_attention, causal_attention_backward

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    g = torch.randn(2, 4, 64, 32, device="cuda", dtype=dtype)
    rows = list(range(16, 32)) + list(range(48, 64))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad(ref[:, :, rows], (q,), g[:, :, rows])[0][:, :, rows]
    with torch.no_grad():
        mine = q[:, :, rows].contiguous()
        out, lse = causal_attention(dk.adapter(forward), rows, range(64))(mine, k, v, 0.0, True)
        gq = causal_attention_backward(dk.adapter(backward), rows, range(64))(
            g[:, :, rows].contiguous(), mine, k, v, out, lse, 0.0, True)[0]
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref[:, :, rows], **tol)
    torch.testing.assert_close(gq, ref_grads, **tol)


def test_gpt_tiny_fp32_on_cuda_matches_eager_cuda():
    from meshplan.driver.verify import verify

    r = verify("gpt", "tiny", steps=5, optimizer="adamw", device="cuda")
    assert r["device"] == "cuda"
    assert r["attention_kernels"] == sorted([dk.EFFICIENT, dk.EFFICIENT_BACKWARD])
    assert r["ok"], r["problems"]  # losses, every parameter and slot
    assert r["measured_peak_bytes"] > 0 and r["attention_fallbacks"] == {}


def test_gpt_tiny_bf16_on_cuda_matches_eager_autocast():
    from meshplan.driver.plan import zoo_strategy
    from meshplan.driver.verify import verify
    from meshplan.ir.mesh import Mesh
    from meshplan.models import model_config

    strategy = zoo_strategy("gpt", model_config("gpt", "tiny"), global_batch_size=8,
                            micro_batch_size=8, precision="bf16")
    r = verify("gpt", "tiny", steps=5, mesh=Mesh(1, 1), strategy=strategy, device="cuda")
    assert r["ok"], r["problems"]  # against eager autocast on the GPU
    assert r["vs_fp32"]["mean_rel_diff"] <= 1e-2, r["vs_fp32"]


def test_two_ranks_share_one_gpu_with_host_staged_gloo():
    from meshplan.driver.plan import zoo_strategy
    from meshplan.driver.verify import verify
    from meshplan.ir.mesh import Mesh
    from meshplan.models import model_config

    strategy = zoo_strategy("gpt", model_config("gpt", "tiny"), tp=2, global_batch_size=4,
                            micro_batch_size=4)
    r = verify("gpt", "tiny", steps=3, mesh=Mesh(1, 2), strategy=strategy, device="cuda",
               run_options={"backend": "gloo"})
    assert r["ok"], r["problems"]
    assert all(v["device"].startswith("cuda") for v in r["ranks"].values())


def test_a_cpu_plan_is_refused_on_cuda():
    from meshplan.driver.plan import plan_model, zoo_strategy
    from meshplan.errors import ConfigError
    from meshplan.ir.mesh import Mesh
    from meshplan.lowering.lower import lower
    from meshplan.models import model_config
    from meshplan.runtime.rank_executor import RankExecutor

    strategy = zoo_strategy("gpt", model_config("gpt", "tiny"), global_batch_size=8,
                            micro_batch_size=8)
    job = plan_model("gpt", "tiny", Mesh(1, 1), strategy).job
    with pytest.raises(ConfigError, match="lowered for cpu but runs on cuda"):
        RankExecutor(job, lower(job, 0, "cpu"), device="cuda")


def test_checkpoint_from_cuda_resumes_like_an_uninterrupted_run(tmp_path):
    """DCP saves the GPU state tensors as they are; a resumed run on the GPU
    sees the losses an uninterrupted one does."""
    from meshplan.driver.plan import zoo_strategy
    from meshplan.driver.run import run
    from meshplan.ir.mesh import Mesh
    from meshplan.models import model_config

    s = zoo_strategy("gpt", model_config("gpt", "tiny"), global_batch_size=8,
                     micro_batch_size=8)
    kw = dict(optimizer="adamw", device="cuda")
    run("gpt", "tiny", Mesh(1, 1), s, steps=2, save_dir=str(tmp_path / "ck"), **kw)
    full = run("gpt", "tiny", Mesh(1, 1), s, steps=4, **kw)
    resumed = run("gpt", "tiny", Mesh(1, 1), s, steps=4, save_dir=str(tmp_path / "ck"),
                  resume=True, **kw)
    assert resumed["first_step"] == 2
    assert resumed["losses"] == pytest.approx(full["losses"][2:], abs=1e-5)
