"""Sizing rules for the transformers configs whose fields do not follow the
common names that `models/hf.py:_fields` sizes (layers, heads, widths).

Invariants:
- Every rule reads the config class's default (`probe`) and our
  `ModelConfig`, and returns the fields to set (a dict, empty when the
  rule does not apply); none builds a model or reads a checkpoint.
- A rule is keyed on the config's own fields (`block_sizes`, `expand`,
  `axial_pos_shape`, ...), so it holds for every type that has them;
  only `QUIRKS` is keyed on a type, each entry with the reason no field
  says it.
- A rule leaves the default's own proportions where our sizes do not set
  them (a bottleneck a quarter of the width stays a quarter).
"""

from __future__ import annotations

import copy
import math
from typing import Any

# `hidden` and `heads` of the ModelConfig are written `h` and `n` below.


def settable(probe, name: str) -> bool:
    """Whether the config takes `name` at all: funnel's and prophetnet's
    layer counts and XLNet's positions are derived properties whose setter
    raises (NotImplementedError), so the fields they derive from get ours."""
    prop = getattr(type(probe), name, None)
    if not isinstance(prop, property):
        return True
    try:  # on a copy: longcat_flash's setter writes num_layers, which must not stick
        prop.__set__(copy.copy(probe), getattr(probe, name))
    except (NotImplementedError, AttributeError):  # AttributeError: no setter at all
        return False
    return True


def width(name: str, v, probe, cfg) -> int | None:
    """Our size for a width under a name `hf._width` does not know, or None."""
    head = cfg.hidden // cfg.heads
    if name == "d_head":  # funnel, XLNet (which checks d_head == d_model // n_head)
        return head
    if name in ("d_inner", "ffn_hidden_size", "expert_ffn_hidden_size"):
        return 4 * cfg.hidden  # funnel, XLNet; falcon, DBRX's and longcat_flash's experts
        return 4 * cfg.hidden
    if name == "index_num_heads":  # kolibri1_1's sparse-attention indexer: at most the
        # queries one key head serves (its check), under hf._fields' grouped keys. The
        # DeepSeek-style `index_n_heads` (deepseek_v32, glm_moe_dsa, ...) need no such
        # bound and were measured equal as they are, so they are left.
        return max(1, cfg.heads // max(1, cfg.heads // 2))
    if name == "embedding_size" and v == getattr(probe, "hidden_size", None):
        return cfg.hidden  # SqueezeBERT (and ConvBERT, RoFormer) want them equal
    return None


def fields(probe, cfg) -> dict:
    """The fields of `probe`'s config that follow from our sizes by its own
    structure: each rule below, in turn."""
    kw: dict = {}
    for rule in (_blocks, _ssm_heads, _bottleneck, _axial, _layer_kinds, _rope_per_kind):
        kw.update(rule(probe, cfg))
    return kw


def _blocks(probe, cfg) -> dict:
    """Funnel: its layers come as `block_sizes` (between blocks it halves the
    sequence); ours are spread over its blocks, the first taking the rest."""
    blocks = getattr(probe, "block_sizes", None)
    if not isinstance(blocks, (list, tuple)) or not blocks:
        return {}
    n = min(len(blocks), cfg.layers)
    sizes = [cfg.layers // n + (i < cfg.layers % n) for i in range(n)]
    return {"block_sizes": sizes, "block_repeats": [1] * n}


def _ssm_heads(probe, cfg) -> dict:
    """Mamba-2: `num_heads` heads of `head_dim` span `expand` times the width
    (its config checks the product), in `n_groups` groups dividing them."""
    if not all(n in vars(probe) for n in ("expand", "num_heads", "head_dim")):
        return {}
    kw = {"num_heads": cfg.heads, "head_dim": probe.expand * cfg.hidden // cfg.heads}
    if isinstance(getattr(probe, "n_groups", None), int):
        kw["n_groups"] = math.gcd(probe.n_groups, cfg.heads)
    return kw


def _bottleneck(probe, cfg) -> dict:
    """MobileBERT: its embeddings and its layers' bottleneck are a fraction
    of the width (128 of 512), and its LM head is as wide as the difference."""
    if not isinstance(getattr(probe, "intra_bottleneck_size", None), int):
        return {}
    return {name: max(1, getattr(probe, name) * cfg.hidden // probe.hidden_size)
            for name in ("embedding_size", "intra_bottleneck_size")}


def _axial(probe, cfg) -> dict:
    """Reformer: in training its axial positions must multiply to the
    sequence length, their widths add up to the hidden size, and the
    sequence be a multiple of its attention chunks."""
    shape = getattr(probe, "axial_pos_shape", None)
    if not isinstance(shape, (list, tuple)) or len(shape) != 2:
        return {}
    first = next(d for d in range(int(math.isqrt(cfg.seq_len)), 0, -1) if cfg.seq_len % d == 0)
    dims = probe.axial_pos_embds_dim
    part = dims[0] * cfg.hidden // sum(dims)
    return {"axial_pos_shape": [first, cfg.seq_len // first],
            "axial_pos_embds_dim": [part, cfg.hidden - part],
            "local_attn_chunk_length": cfg.seq_len // 2, "lsh_attn_chunk_length": cfg.seq_len // 2,
            "attention_head_size": cfg.hidden // cfg.heads, "feed_forward_size": 4 * cfg.hidden}


def _layer_kinds(probe, cfg) -> dict:
    """lfm2_moe leaves `layer_types` to the checkpoint (None), where its dense
    sibling lfm2 defaults to attention in every layer: that, at our depth."""
    if "layer_types" in vars(probe) and probe.layer_types is None:
        return {"layer_types": ["full_attention"] * cfg.layers}
    return {}


def _rope_per_kind(probe, cfg) -> dict:
    """Cohere Compass leaves `rope_parameters` to the checkpoint (empty) but
    reads one entry per layer kind: transformers' default RoPE for each."""
    if getattr(probe, "rope_parameters", None) != {}:
        return {}
    default = {"rope_type": "default", "rope_theta": 10000.0}
    kinds = getattr(probe, "layer_types", None)
    return {"rope_parameters": {k: dict(default) for k in kinds} if kinds else default}


def index_list(v) -> bool:
    """A per-layer list of earlier layers' indices (kolibri1_1's
    `kv_source_layers`: the layer whose K/V each reads, some other than
    itself), which resampling would point at layers that are gone: it is
    left to the config to derive at our depth. An identity list (lfm2's
    `full_attn_idxs`, llama4's `moe_layers`: a set of layers) is not one."""
    return all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= i
               for i, x in enumerate(v)) and any(x < i for i, x in enumerate(v))


def sub_dict(sub) -> dict:
    """A sub-config as the dict its parent is built from, less what it derives
    from its depth: Gemma 4's `per_layer_config` (overrides keyed by the
    default's layer indices), derived again from our `layer_types` as a
    top-level gemma4_text config derives it."""
    return {k: v for k, v in sub.to_dict().items() if k != "per_layer_config"}


# Per-type fields where no config field says what the model needs, each with
# why: a value, a sub-config's fields to merge (a dict), or a function of our
# ModelConfig.
QUIRKS: dict[str, dict[str, Any]] = {
    # ESMC refuses grouped-query attention (its validator), yet its config has
    # the usual `num_key_value_heads`, which we set to half the heads elsewhere
    "esmc": {"num_key_value_heads": lambda cfg: cfg.heads},
    # DBRX's attention reads `attn_config.rope_theta`, a field DbrxAttentionConfig
    # (transformers 5.25) no longer has; the default model does not build either.
    # Only stored by the layer: the rotary embedding takes the top-level theta.
    # It also clamps queries, keys and values by `clip_qkv` even when that is
    # None (the default), which raises: the released checkpoints' 8.
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # Reformer's LM head asserts `is_decoder` (its causal mask); the flag exists
    # on many configs whose models ignore it, so it is not set by task
    "reformer": {"is_decoder": True},
    # Zamba ties one shared attention block across its hybrid layers and
    # refuses a tie with a single one: resampling 76 layers to 4 keeps one
    # (hybrid in every other layer, as many as we can)
    "zamba": {"layers_block_type": lambda cfg: ["hybrid" if i % 2 else "linear_attention"
                                                for i in range(cfg.layers)]},
}


def quirks(model_type: str, kw: dict, cfg) -> dict:
    """`kw` with the `QUIRKS` of `model_type` laid over it (sub-dicts merged)."""
    out = dict(kw)
    for name, v in QUIRKS.get(model_type, {}).items():
        if callable(v):
            out[name] = v(cfg)
        elif isinstance(v, dict):
            out[name] = {**out.get(name, {}), **v}
        else:
            out[name] = v
    return out
