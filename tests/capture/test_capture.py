"""capture: module paths, FQNs, losses, and one-line errors for bad models."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from meshplan.capture import capture
from meshplan.errors import CaptureError
from meshplan.ir import Role
from meshplan.models import build_model, example_batch, model_config


def test_gpt_ops_keep_module_paths_and_params_keep_fqns():
    cfg = model_config("gpt", "tiny")
    g = capture(build_model(cfg), example_batch(cfg, 2))
    paths = {op.module_path for op in g.ops}
    assert {"blocks.3.attn.qkv", "blocks.0.mlp.fc2", "wte", "head"} <= paths
    params = {v.name: v.meta for v in g.inputs_by_role(Role.PARAM)}
    assert params["blocks.3.attn.qkv.weight"].shape == (192, 64)
    assert params["blocks.3.attn.qkv.weight"].dtype.name == "float32"
    assert all(op.source for op in g.ops)
    assert g.values[g.loss].meta.shape == ()


def test_resnet_buffers_become_updates():
    cfg = model_config("resnet", "tiny")
    g = capture(build_model(cfg), example_batch(cfg, 2))
    buffers = {v.name for v in g.inputs_by_role(Role.BUFFER)}
    updated = {u.name for u in g.updates}
    assert "blocks.0.bn1.running_mean" in buffers
    assert buffers == updated


class _Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


def test_model_without_scalar_loss_is_capture_error():
    with pytest.raises(CaptureError) as e:
        capture(_Logits(), (torch.randn(2, 4),))
    msg = str(e.value)
    assert "not a scalar loss" in msg and "loss_fn=" in msg and "\n" not in msg


def test_loss_fn_turns_outputs_into_a_loss():
    m = _Logits()
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    g = capture(m, (x,), loss_fn=nn.functional.cross_entropy, targets=(y,))
    assert g.values[g.loss].meta.shape == ()
    assert {v.name for v in g.inputs_by_role(Role.PARAM)} == {"fc.weight", "fc.bias"}
    assert any(op.module_path == "fc" for op in g.ops)


def test_inputs_that_do_not_fit_are_capture_error():
    cfg = model_config("resnet", "tiny")
    images, labels = example_batch(cfg, 2)
    with pytest.raises(CaptureError) as e:
        capture(build_model(cfg), (images[:, :1], labels))  # 1 channel, model wants 3
    assert "torch.export failed" in str(e.value) and "\n" not in str(e.value)
    # the model's own line that raised, outside torch and meshplan
    assert "at meshplan/models/resnet.py, line" in str(e.value), str(e.value)


@pytest.mark.slow
def test_gpt3_175b_captures_on_meta_without_weights():
    cfg = model_config("gpt", "gpt3-175b")
    module = build_model(cfg, device="meta")
    g = capture(module, example_batch(cfg, 1, device="meta"))
    params = g.inputs_by_role(Role.PARAM)
    assert len(params) == len(list(module.parameters()))
    assert sum(p.meta.numel for p in params) == sum(p.numel() for p in module.parameters())
    per_layer, fixed = _ops_per_layer(cfg)
    assert len(g.ops) == fixed + cfg.layers * per_layer
    assert all(p.is_meta for p in module.parameters())


def _ops_per_layer(cfg) -> tuple[int, int]:
    """(ops per layer, ops outside the layers) of `cfg`'s model, from captures
    of its 1- and 2-layer versions."""
    one, two = (len(capture(build_model(c, device="meta"), example_batch(c, 1, device="meta")).ops)
                for c in (replace(cfg, layers=1), replace(cfg, layers=2)))
    return two - one, 2 * one - two


class TopkTooLarge(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x):
        return self.w(x).topk(8, dim=-1).values.sum()  # k = 8 > 4: fails in export


def test_a_failing_op_at_export_is_one_line_without_torchs_traceback():
    import logging

    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("torch._subclasses.fake_tensor")  # torch's own, propagate off
    log.addHandler(handler)
    try:
        with pytest.raises(CaptureError, match="k not in range"):
            capture(TopkTooLarge(), (torch.randn(2, 4),))
    finally:
        log.removeHandler(handler)
    assert not records, records[0].getMessage()  # its traceback would bury our one line


class Weighted(nn.Module):
    """A forward that makes a tensor constant of `n` distinct elements."""

    def __init__(self, n: int):
        super().__init__()
        self.lin, self.n = nn.Linear(4, 4), n

    def forward(self, x):
        w = torch.tensor([float(i) for i in range(self.n)])
        return (self.lin(x).sum() * w).mean()


def test_a_small_constant_is_made_in_the_graph_and_a_large_one_is_refused():
    torch.manual_seed(0)
    graph = capture(Weighted(5), (torch.randn(2, 4),))
    assert sum(op.kind == "aten.scalar_tensor.default" for op in graph.ops) == 5
    with pytest.raises(CaptureError) as err:
        capture(Weighted(65), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "\n" not in msg and "register_buffer" in msg and "more than 64 elements" in msg
    assert "test_capture.py, line" in msg


class _CastsItsRouter(nn.Module):
    """Switch Transformers' router: `.to(fp32)` on a submodule in every forward."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x, y):
        self.router = self.router.to(torch.float32)
        h = torch.softmax(self.router(x), dim=-1)
        return nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def test_a_to_that_changes_nothing_in_the_forward_trains_as_eager():
    import meshplan.api as mp

    torch.manual_seed(0)
    model = _CastsItsRouter()
    batches = [(torch.randn(4, 4), torch.randn(4)) for _ in range(2)]
    job = mp.plan(mp.capture(model, batches[0]), mp.Mesh(1, 1),
                  mp.Strategy(global_batch_size=4, micro_batch_size=4))
    r = mp.verify(job, model, batches)
    assert r["ok"], r["problems"]


def test_planted_without_the_unchanged_to_the_cast_fails_export(monkeypatch):
    from contextlib import nullcontext

    from meshplan.capture import torch_export

    monkeypatch.setattr(torch_export, "_to_that_changes_nothing", nullcontext)
    with pytest.raises(CaptureError, match="Couldn't swap"):
        capture(_CastsItsRouter(), (torch.randn(4, 4), torch.randn(4)))
