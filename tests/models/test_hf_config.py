"""The offline builder's arithmetic (models/hf.py): each type's task, the
per-layer lists, the widths, the size guard, and the layer lists capture
records for an encoder-decoder."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from meshplan.capture.structure import structure_facts  # noqa: E402
from meshplan.errors import ConfigError  # noqa: E402
from meshplan.models import (  # noqa: E402
    build_model,
    example_batch,
    hf,  # noqa: E402
    hf_sizes,  # noqa: E402
    model_config,
)


@pytest.mark.parametrize("model_type, task", [
    ("gpt2", hf.CAUSAL), ("llama", hf.CAUSAL), ("bert", hf.MASKED), ("xlm-roberta", hf.MASKED),
    ("t5", hf.SEQ2SEQ), ("bart", hf.SEQ2SEQ), ("marian", hf.SEQ2SEQ)])
def test_each_type_is_trained_as_its_task(model_type, task):
    assert hf.task_of(model_config(f"hf:{model_type}")) == task


@pytest.mark.parametrize("n, layers", [(26, 4), (35, 4), (5, 2), (8, 8), (3, 7)])
def test_per_layer_lists_keep_their_first_and_last_kind(n, layers):
    kinds = ["sliding"] * (n - 1) + ["full"]
    got = hf._per_layer(SimpleNamespace(num_hidden_layers=n, layer_types=kinds,
                                        by_index={0: "a", n - 1: "b"}), layers)
    if n == layers:
        assert got == {}
        return
    assert len(got["layer_types"]) == layers
    assert got["layer_types"][0] == "sliding" and got["layer_types"][-1] == "full"
    assert set(got["by_index"]) == {k for k in (0, n - 1) if k < layers}


def test_an_encoder_decoder_gets_our_sizes_in_both_stacks_and_both_layer_lists():
    cfg = model_config("hf:t5", "tiny", layers=3)
    conf = hf.hf_config(cfg)
    assert (conf.num_layers, conf.num_decoder_layers, conf.d_model, conf.d_kv) == (3, 3, 64, 16)
    assert conf.dropout_rate == 0.0 and conf.tie_word_embeddings  # T5 ties, by its default
    module = build_model(cfg, device="meta")
    assert structure_facts(module).layers == "model.encoder.block,model.decoder.block"
    # its encoder is given a mask, as a real batch (LongT5 makes none of its own under export)
    assert module.masked and not build_model(model_config("hf:gpt2", "tiny"), "meta").masked
    inputs, labels = example_batch(cfg, 2)
    assert (labels != -100).all() and (inputs == 0).any()  # denoise the whole sequence


def test_a_model_far_larger_than_its_sizes_is_refused_naming_its_largest_parameter(monkeypatch):
    monkeypatch.setattr(hf, "TOO_LARGE", 0.5)  # tiny gpt2 is about 1x its sizes
    with pytest.raises(ConfigError) as e:
        build_model(model_config("hf:gpt2", "tiny"))
    assert "\n" not in str(e.value) and "the largest, transformer." in str(e.value)


def test_layerdrop_is_off_and_dropout_is_ours():
    """LayerDrop skips a whole layer at random, a branch on a value: off, as
    M2M-100's default 0.05 would refuse the model at capture."""
    conf = hf.hf_config(model_config("hf:m2m_100", "tiny", dropout=0.1))
    assert (conf.encoder_layerdrop, conf.decoder_layerdrop) == (0.0, 0.0)
    assert conf.dropout == conf.attention_dropout == 0.1


def test_a_type_whose_positions_follow_padding_gets_a_pad_token():
    """ESM leaves its pad token to the checkpoint; its positions need one."""
    conf = hf.hf_config(model_config("hf:esm", "tiny"))
    assert conf.pad_token_id == 1
    assert conf.max_position_embeddings == model_config("hf:esm", "tiny").seq_len + 2


def test_a_pp_plan_naming_no_module_falls_back_to_the_longest_layer_list():
    """hrm_text's `_pp_plan` names `layers`, which its model does not have."""
    module = build_model(model_config("hf:hrm_text", "tiny"), device="meta")
    assert "layers" in module.model.model._pp_plan and not hasattr(module.model.model, "layers")
    assert structure_facts(module).layers == "model.model.L_module.layers"


@pytest.mark.parametrize("model_type", ["mllama", "inkling2_text", "zamba2"])
def test_layers_of_several_classes_are_the_layer_list(model_type):
    """Mllama's self- and cross-attention layers, Inkling 2's full and sliding
    ones, Zamba 2's Mamba and hybrid ones: one list of blocks of two classes
    (Zamba 2's one-class lists are a layer's adapters, which pp2 once split)."""
    module = build_model(model_config(f"hf:{model_type}", "tiny"), device="meta")
    assert structure_facts(module).layers == "model.model.layers"


def test_expert_counts_left_to_the_checkpoint_get_ours():
    """dots1's config leaves its experts, those per token and its shared ones
    to the checkpoint (None); its experts' own width says it has them."""
    conf = hf.hf_config(model_config("hf:dots1", "tiny"))
    assert (conf.n_routed_experts, conf.num_experts_per_tok, conf.n_shared_experts) == (4, 2, 1)
    dense = hf.hf_config(model_config("hf:llama", "tiny"))
    assert not any(hasattr(dense, n) for n in ("n_routed_experts", "num_experts_per_tok"))


def test_grouped_routing_under_its_other_names_gets_our_sizes():
    """Bailing's `num_expert_group` and `num_experts_per_token` (8 of 512 in
    8 groups by default: 4 experts in 8 groups was a view of width 0)."""
    conf = hf.hf_config(model_config("hf:bailing_hybrid", "tiny"))
    assert (conf.num_experts, conf.num_expert_group, conf.num_experts_per_token) == (4, 2, 2)


def test_an_encoder_decoder_with_no_pad_token_gets_one():
    """EncoderDecoderModel's config leaves pad and start tokens to the
    checkpoint; shifting the labels right into the decoder needs both."""
    conf = hf.hf_config(model_config("hf:encoder-decoder", "tiny"))
    assert (conf.pad_token_id, conf.decoder_start_token_id) == (0, 0)
    assert hf.hf_config(model_config("hf:bart", "tiny")).pad_token_id == 1  # its own kept


# models/hf_sizes.py: configs whose fields do not follow the common names


def test_a_layer_count_derived_from_other_fields_is_set_through_them():
    """funnel's and prophetnet's `num_hidden_layers` and XLNet's positions are
    properties whose setter raises: ours go to the fields they come from."""
    tiny = model_config("hf:gpt2", "tiny")
    funnel = hf.hf_config(model_config("hf:funnel", "tiny"))
    assert list(funnel.block_sizes) == [2, 1, 1] and funnel.num_hidden_layers == tiny.layers
    assert (funnel.d_head, funnel.d_inner) == (16, 256)
    prophet = hf.hf_config(model_config("hf:prophetnet", "tiny"))
    assert (prophet.num_encoder_layers, prophet.num_decoder_layers) == (4, 4)
    assert (prophet.num_encoder_attention_heads, prophet.num_decoder_attention_heads) == (4, 4)
    xlnet = hf.hf_config(model_config("hf:xlnet", "tiny"))
    assert (xlnet.d_model, xlnet.d_head, xlnet.d_inner) == (64, 16, 256)


def test_an_aliased_size_is_set_under_its_own_name():
    """DBRX derives its experts' width from `d_model` before it applies the
    `hidden_size` alias: set by the alias, the experts kept 2048."""
    conf = hf.hf_config(model_config("hf:dbrx", "tiny"))
    assert conf.d_model == conf.ffn_config.hidden_size == 64
    assert conf.ffn_config.ffn_hidden_size == 256
    # hf_sizes.QUIRKS: what DbrxAttentionConfig lacks, and a clip the default makes raise
    assert (conf.attn_config.rope_theta, conf.attn_config.clip_qkv) == (10000.0, 8.0)


def test_embeddings_keep_their_share_of_the_width():
    """SqueezeBERT's embeddings are as wide as its layers; MobileBERT's and its
    bottleneck a quarter (its LM head is as wide as the difference)."""
    assert hf.hf_config(model_config("hf:squeezebert", "tiny")).embedding_size == 64
    mobile = hf.hf_config(model_config("hf:mobilebert", "tiny"))
    assert (mobile.embedding_size, mobile.intra_bottleneck_size) == (16, 16)
    assert hf.hf_config(model_config("hf:albert", "tiny")).embedding_size == 128  # as before


def test_ssm_heads_span_the_expanded_width():
    conf = hf.hf_config(model_config("hf:mamba2", "tiny"))
    assert conf.num_heads == 4 and conf.num_heads * conf.head_dim == conf.expand * 64
    assert conf.num_heads % conf.n_groups == 0


def test_axial_positions_multiply_to_the_sequence():
    cfg = model_config("hf:reformer", "tiny")
    conf = hf.hf_config(cfg)
    assert conf.axial_pos_shape[0] * conf.axial_pos_shape[1] == cfg.seq_len
    assert sum(conf.axial_pos_embds_dim) == 64 and conf.is_decoder  # QUIRKS: its LM head's
    assert cfg.seq_len % conf.local_attn_chunk_length == 0


def test_fields_left_to_the_checkpoint_get_defaults():
    """lfm2_moe's `layer_types` (None): attention everywhere, as lfm2's;
    Cohere Compass's `rope_parameters` ({}): default RoPE per layer kind."""
    assert hf.hf_config(model_config("hf:lfm2_moe", "tiny")).layer_types == ["full_attention"] * 4
    conf = hf.hf_config(model_config("hf:cohere_compass_text", "tiny"))
    assert set(conf.rope_parameters) == set(conf.layer_types)
    assert all(p["rope_theta"] == 10000.0 for p in conf.rope_parameters.values())


def test_a_list_of_source_layers_is_derived_at_our_depth():
    assert hf_sizes.index_list([0, 1, 2, 2, 4]) and not hf_sizes.index_list([0, 1, 2, 3])
    assert not hf_sizes.index_list([1, 1, 0, 1])  # llama4's no-RoPE flags
    conf = hf.hf_config(model_config("hf:kolibri1_1", "tiny"))
    sources = conf.kv_source_layers
    assert len(sources) == 4 and all(s <= i for i, s in enumerate(sources))
    assert conf.index_num_heads <= conf.num_attention_heads // conf.num_key_value_heads


def test_a_sub_config_derives_its_per_layer_overrides_at_our_depth():
    """Gemma 4's text_config: overrides keyed by the default's 30 layers."""
    text = hf.hf_config(model_config("hf:gemma4", "tiny")).text_config
    assert text.num_hidden_layers == 4 and text.layer_types[-1] == "full_attention"
    assert {int(k) for k in text.to_dict()["per_layer_config"]} == {3}  # its full layer
    assert "per_layer_config" not in hf_sizes.sub_dict(text)


def test_per_type_quirks():
    assert hf.hf_config(model_config("hf:esmc", "tiny")).num_key_value_heads == 4
    zamba = hf.hf_config(model_config("hf:zamba", "tiny", layers=6))
    assert zamba.layers_block_type.count("hybrid") == 3  # one block tied across several


def test_a_rotary_head_dim_beside_latent_attention_follows_its_rotary_part():
    """longcat_flash's `head_dim` is the width its RoPE rotates, MLA's
    `qk_rope_head_dim` (64 and 64 by default)."""
    conf = hf.hf_config(model_config("hf:longcat_flash", "tiny"))
    assert conf.head_dim == conf.qk_rope_head_dim == 8


def test_the_layer_list_is_one_the_forward_runs():
    """ModernVBERT's vision encoder holds its longest list of blocks, and a
    text batch never enters it: every parallel layout was refused ('layer
    pattern ... matches no forward op's module path'). The layer list is now
    the longest the forward runs, the text model's."""
    from meshplan.driver.plan import capture_zoo

    cfg = model_config("hf:modernvbert", "tiny")
    module = build_model(cfg, device="meta")
    assert structure_facts(module).layers.startswith("model.model.vision_model")  # all modules
    layers = capture_zoo(cfg, 2).facts.structure.layers
    assert layers == "model.model.text_model.layers", layers


@pytest.mark.parametrize("model_type", ["mllama", "emu3", "mamba2", "falcon_h1", "gpt2", "t5"])
def test_an_export_rebuilds_the_class_trained_from_its_record(model_type):
    """`meta_model` of a record's config and class is the model trained:
    mllama's and emu3's causal LMs hold a text sub-config no Auto class maps,
    and mamba2's `time_step_limit` holds an infinity, which transformers
    writes as `{"__float__": "Infinity"}`."""
    import json

    import torch

    with torch.device("meta"):
        trained = hf.build_hf(model_config(f"hf:{model_type}")).model
    config = json.loads(trained.config.to_json_string(use_diff=False))
    built = hf.meta_model(config, type(trained).__name__)
    assert type(built) is type(trained)
    assert {n: p.shape for n, p in built.state_dict().items()} == \
        {n: p.shape for n, p in trained.state_dict().items()}


def test_a_non_finite_float_of_a_config_is_a_float_again():
    got = hf._special_floats({"a": [0.0, {"__float__": "Infinity"}],
                              "b": {"__float__": "-Infinity"}, "c": {"__float__": "NaN"},
                              "d": {"__float__": 1, "e": 2}})
    assert got["a"] == [0.0, float("inf")] and got["b"] == float("-inf")
    assert got["c"] != got["c"] and got["d"] == {"__float__": 1, "e": 2}


def test_a_saved_configs_sizes_are_read_where_its_type_keeps_them(tmp_path):
    """BART's `encoder_layers` and `d_model`, DistilBERT's `n_layers` and
    `dim`, funnel's block sizes, nemotron_h's layer kinds; a multimodal
    model's sizes in its `text_config` (gemma3): read as the run's sizes
    (every type of the survey has them; `benchmarks/hf_round_trip.py`)."""
    import json

    bart = {"model_type": "bart", "encoder_layers": 3, "decoder_layers": 3,
            "encoder_attention_heads": 4, "d_model": 64, "vocab_size": 300,
            "max_position_embeddings": 128}
    gemma3 = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 2, "num_attention_heads": 4,
        "hidden_size": 32, "vocab_size": 400, "max_position_embeddings": 96},
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 7}}
    distilbert = {"model_type": "distilbert", "n_layers": 2, "n_heads": 4, "dim": 64,
                  "vocab_size": 300, "max_position_embeddings": 64}
    funnel = {"model_type": "funnel", "block_sizes": [2, 1, 1], "n_head": 4, "d_model": 64,
              "vocab_size": 300}
    nemotron_h = {"model_type": "nemotron_h", "layers_block_type": ["mamba", "attention"],
                  "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 300}
    for name, conf, want in (("bart", bart, (3, 4, 64, 300)), ("gemma3", gemma3, (2, 4, 32, 400)),
                             ("distilbert", distilbert, (2, 4, 64, 300)),
                             ("funnel", funnel, (4, 4, 64, 300)),
                             ("nemotron_h", nemotron_h, (2, 4, 64, 300))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(conf))
        got = hf.saved_fields(str(tmp_path / name), "hf:", "tiny", {})
        assert (got["layers"], got["heads"], got["hidden"], got["vocab"]) == want
        assert got["seq_len"] <= conf.get("max_position_embeddings", 96)
    with pytest.raises(ConfigError, match="differs from encoder_layers 3"):
        hf.saved_fields(str(tmp_path / "bart"), "hf:", "tiny", {"layers": 2})
