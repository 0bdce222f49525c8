"""Model zoo tests: presets, shapes, training steps, determinism, errors."""

import math
import re

import pytest
import torch

from meshplan.errors import ConfigError
from meshplan.models import (
    MODELS,
    PRESETS,
    build_model,
    example_batch,
    layer_pattern,
    model_config,
    param_count,
)


@pytest.mark.parametrize("model", MODELS)
def test_tiny_preset_trains_one_sgd_step(model):
    torch.manual_seed(0)
    cfg = model_config(model, "tiny")
    net = build_model(cfg)
    batch = example_batch(cfg, batch_size=4, seed=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    loss = net(*batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, net.parameters(), strict=True))
    assert torch.isfinite(net(*batch))


def test_gpt_tiny_initial_loss_is_about_ln_vocab():
    torch.manual_seed(0)
    cfg = model_config("gpt", "tiny")
    loss = build_model(cfg)(*example_batch(cfg, 8)).item()
    assert abs(loss - math.log(cfg.vocab)) < 0.5


def test_gpt3_175b_on_meta_allocates_nothing():
    cfg = model_config("gpt", "gpt3-175b")
    net = build_model(cfg, device="meta")
    assert all(p.is_meta for p in net.parameters())
    assert 174e9 < param_count(net) < 176e9


def test_bert_large_param_count():
    cfg = model_config("bert", "bert-large")
    net = build_model(cfg, device="meta")
    total = param_count(net)
    # The untied MLM head adds vocab*hidden + vocab on top of published
    # BERT-large (~335M without token-type embeddings and pooler).
    untied_head = cfg.vocab * cfg.hidden + cfg.vocab
    assert 334e6 < total - untied_head < 340e6
    h, v = cfg.hidden, cfg.vocab
    embeddings = v * h + cfg.seq_len * h + 2 * h  # wte, wpe, ln_emb
    layer = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h
    head = (h * h + h) + 2 * h + untied_head  # head_dense, head_ln, head
    assert total == embeddings + cfg.layers * layer + head


def test_resnet50_param_count_matches_reference():
    cfg = model_config("resnet", "resnet50")
    assert cfg.layers == 16 and cfg.num_classes == 1000
    net = build_model(cfg, device="meta")
    assert abs(param_count(net) - 25.5e6) < 0.3e6


@pytest.mark.parametrize("model", MODELS)
def test_example_batch_deterministic_per_seed(model):
    cfg = model_config(model, "tiny")
    a = example_batch(cfg, 3, seed=7)
    b = example_batch(cfg, 3, seed=7)
    c = example_batch(cfg, 3, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("model", MODELS)
def test_example_batch_on_meta_matches_cpu_shapes(model):
    cfg = model_config(model, "tiny")
    real = example_batch(cfg, 2)
    meta = example_batch(cfg, 2, device="meta")
    assert all(m.is_meta for m in meta)
    assert [(t.shape, t.dtype) for t in real] == [(t.shape, t.dtype) for t in meta]


def test_example_batch_does_not_touch_global_rng():
    state = torch.get_rng_state()
    example_batch(model_config("bert", "tiny"), 4, seed=3)
    assert torch.equal(state, torch.get_rng_state())


def test_gpt_targets_are_next_tokens():
    tokens, targets = example_batch(model_config("gpt", "tiny"), 2)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])


def test_bert_labels_and_masking():
    cfg = model_config("bert", "tiny")
    tokens, labels = example_batch(cfg, 64, seed=5)
    labelled = labels != -100
    assert labelled.any(dim=1).all()
    assert (tokens[labelled] == 0).all()  # masked inputs carry [MASK]=0
    assert (tokens[~labelled] != 0).all()
    assert (labels[labelled] > 0).all()
    fraction = labelled.float().mean().item()
    assert 0.1 < fraction < 0.3  # ~15% plus one forced position per row of 16


def test_bert_loss_finite_even_for_single_row():
    torch.manual_seed(0)
    cfg = model_config("bert", "tiny")
    net = build_model(cfg)
    for seed in range(5):
        assert torch.isfinite(net(*example_batch(cfg, 1, seed=seed)))


@pytest.mark.parametrize(
    ("model", "path"),
    [("gpt", "blocks.3.attn.qkv"), ("bert", "blocks.3.attn.qkv"), ("resnet", "blocks.0")],
)
def test_module_paths(model, path):
    cfg = model_config(model, "tiny")
    modules = dict(build_model(cfg, device="meta").named_modules())
    assert path in modules
    pattern = re.compile(layer_pattern(cfg))
    indices = {int(m.group(1)) for n in modules if (m := pattern.match(n))}
    assert indices == set(range(cfg.layers))


def test_gpt_module_names_and_untied_head():
    net = build_model(model_config("gpt", "tiny"), device="meta")
    names = set(dict(net.named_modules()))
    expected = {"wte", "wpe", "ln_f", "head", "blocks.0.ln1", "blocks.0.ln2",
                "blocks.0.attn.proj", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2"}
    assert expected <= names
    assert net.head.bias is None and net.head.weight is not net.wte.weight


def test_qkv_split_gives_whole_heads():
    """Zeroing one head's slice of qkv output changes only that head's output."""
    torch.manual_seed(0)
    cfg = model_config("gpt", "tiny")
    attn = build_model(cfg).blocks[0].attn
    x = torch.randn(2, cfg.seq_len, cfg.hidden)
    per_head = 3 * cfg.hidden // cfg.heads
    with torch.no_grad():
        attn.proj.weight.copy_(torch.eye(cfg.hidden))
        attn.proj.bias.zero_()
        base = attn(x)
        attn.qkv.weight[:per_head].zero_()
        attn.qkv.bias[:per_head].zero_()
        changed = (attn(x) - base).abs().amax(dim=(0, 1)) > 0
    head_dim = cfg.hidden // cfg.heads
    assert changed[:head_dim].any() and not changed[head_dim:].any()


def test_unknown_model_message():
    with pytest.raises(ConfigError, match=r"unknown model 'gtp': choose one of gpt, bert, resnet"):
        model_config("gtp")


def test_unknown_size_message():
    with pytest.raises(ConfigError) as info:
        model_config("gpt", "huge")
    assert str(info.value) == \
        "unknown size 'huge' for gpt: choose one of tiny, small, gpt3-175b, 8b, 405b"


def test_heads_not_dividing_hidden_message():
    with pytest.raises(ConfigError) as info:
        model_config("gpt", "tiny", heads=5)
    msg = str(info.value)
    assert "\n" not in msg
    assert "heads=5" in msg and "hidden=64" in msg
    assert msg.endswith("1, 2, 4, 8, 16, 32, 64")


@pytest.mark.parametrize("field", ["layers", "heads", "hidden", "seq_len", "vocab"])
def test_non_positive_sizes_rejected(field):
    with pytest.raises(ConfigError, match=field) as info:
        model_config("bert", "tiny", **{field: 0})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("flag", ["layers", "heads", "seq_len", "vocab"])
def test_resnet_rejects_transformer_flags(flag):
    with pytest.raises(ConfigError, match=flag):
        model_config("resnet", "tiny", **{flag: 2})


def test_overrides_apply_and_none_is_ignored():
    cfg = model_config("gpt", "small", layers=2, hidden=128, heads=None)
    assert (cfg.layers, cfg.hidden, cfg.heads) == (2, 128, PRESETS["gpt"]["small"].heads)
    net = model_config("resnet", "tiny", hidden=4, blocks=(1, 2, 1, 1))
    assert (net.width, net.hidden, net.layers) == (4, 4, 5)
    assert len(build_model(net, device="meta").blocks) == 5


def test_all_presets_build_on_meta():
    for model, sizes in PRESETS.items():
        for size, cfg in sizes.items():
            assert model_config(model, size) == cfg
            net = build_model(cfg, device="meta")
            assert len(net.blocks) == cfg.layers
