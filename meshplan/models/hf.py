"""Models from Hugging Face `transformers`, built offline from a config.

Invariants:
- A model is named `hf:<model_type>` (`hf:gpt2`, `hf:bert`, `hf:llama`);
  it is built from `transformers`' own config class for that type with the
  `ModelConfig`'s sizes, random weights (the global RNG, as zoo models),
  every dropout `ModelConfig.dropout` (0 unless asked), and nothing
  downloaded: `transformers` is an optional extra (`pip install -e
  '.[hf]'`), imported only when such a model is asked for. The sizes go
  under the common names here, under a config's own structure
  (`block_sizes`, SSM heads, ...) in `hf_sizes`.
- The module is `HFLoss(model)`: `forward(input_ids, labels)` returns the
  model's own `.loss`, so it captures like a zoo model. A type is trained
  as one task (`task_of`): a causal LM takes labels equal to the inputs
  (transformers shifts them); a masked LM takes BERT-style masked inputs
  with labels -100 where unmasked; an encoder-decoder (T5, BART, Marian;
  preferred where a type has a decoder-only variant too) denoises: masked
  inputs to the encoder (with its attention mask, every token kept), the
  whole sequence as labels, from which transformers derives the decoder's
  inputs. Its encoder and its decoder each get `layers` layers.
- Tying follows the config (`tie_word_embeddings`), overridable through
  `ModelConfig.tie_embeddings`.
- A model may instead come from a `save_pretrained` directory
  (`ModelConfig.source`, `saved_fields`): its config.json is the model,
  exactly, but for dropout (as above), and where no Auto class maps its
  config type (the text LM of a multimodal type, `MllamaTextConfig`) the
  class its `architectures` names is; the ModelConfig's sizes are read
  from it (a size given beside it must agree), its sequence length is the
  one trained at (the preset's, capped by the model's positions).
"""

from __future__ import annotations

import importlib
import inspect
import json
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from meshplan.errors import ConfigError
from meshplan.models import hf_sizes

PREFIX = "hf:"
# The model types tests/models/test_hf_families.py trains equal to eager
# (2 steps at 1 rank; those of SPLIT_TESTED also at tp2*pp2), and the
# README's list: any other type is tried, or refused with one line.
TESTED = (
    # causal LMs
    "gpt2", "gpt_neox", "gptj", "gpt_bigcode", "codegen", "ctrl", "biogpt", "bloom",
    "falcon", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "cohere", "granite",
    "glm", "internlm3", "phi", "phi3", "olmo", "bitnet", "lfm2", "mamba", "cpmant",
    "xlm", "xlnet", "hrm_text", "cohere_compass_text", "gemma4_unified",
    # config fields under their own names (models/hf_sizes.py)
    "lfm2_moe", "longcat_flash",
    # torch.autograd.Functions with their own backward (kept whole by capture)
    "recurrent_gemma", "yoso",
    # masked LMs
    "bert", "albert", "distilbert", "electra", "roberta", "xlm-roberta", "camembert",
    "deberta-v2", "megatron-bert", "modernbert", "data2vec-text", "esm", "esmc", "funnel",
    "mobilebert", "squeezebert",
    # encoder-decoders
    "bart", "mbart", "t5", "marian", "pegasus", "m2m_100", "longt5",
    # mixtures of experts (transformers' grouped matmul; experts replicated over tp)
    "mixtral", "qwen2_moe", "olmoe", "gpt_oss",
    # llama4: experts, and a rotary product with complex frequencies
    "llama4_text",
    # DeepSeek: multi-head latent attention, grouped routing, shared experts
    "deepseek_v2", "deepseek_v3",
    # dots1: DeepSeek-V3's kind, its expert counts left to the checkpoint
    "dots1",
    # phimoe: routing sampled in training (in-place exponential_, uniform_), its own backward
    "phimoe",
)
SPLIT_TESTED = ("gpt2", "gptj", "bloom", "llama", "mamba", "bert", "albert", "xlm-roberta",
                "electra", "bart", "t5", "mixtral", "deepseek_v3", "phimoe")
ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
            "deberta-v2", "camembert", "megatron-bert", "modernbert")
# a mixture of experts' config fields: its experts per layer, those each token takes
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k",
                      "moe_k")
# built here, it keeps a few: 4 experts, 2 per token; DeepSeek's grouped
# routing (experts in `n_group` groups, a token's taken from `topk_group`
# of them) in 2 groups of 2, one of which a token takes; one shared expert
# where the config leaves their count to the checkpoint
_EXPERTS = dict.fromkeys(_EXPERT_COUNTS, 4) | dict.fromkeys(_EXPERTS_PER_TOKEN, 2) | {
    "n_group": 2, "num_expert_group": 2, "topk_group": 1, "n_shared_experts": 1}
TOO_LARGE = 40  # a built model over this many times its sizes' transformer is refused
CAUSAL, MASKED, SEQ2SEQ = "causal-LM", "masked-LM", "encoder-decoder"
_SIZES = {  # name -> (layers, heads, hidden, seq_len, vocab)
    "tiny": (4, 4, 64, 16, 128),
    "small": (8, 8, 256, 128, 1024),
}


class HFLoss(nn.Module):
    """A transformers model whose forward returns its loss. An encoder-decoder
    (`masked`: its config's `is_encoder_decoder`, so not the speech models
    trained as one, whose mask places audio) is given its encoder's attention
    mask, as a real batch comes with one: under export, T5's kind (LongT5)
    makes none of its own and fails without it. The mask keeps every token,
    or with `pad_id` (paired data, `data/pairs.py`) every token but the
    source's padding. Packed rows (`--pack`, `data/pairs.py`) come with
    position ids that restart at each pair, from which transformers masks
    each token's attention to its own pair."""

    def __init__(self, model: nn.Module, masked: bool = False, pad_id: int = -1):
        super().__init__()
        self.model = model
        self.masked = masked
        self.pad_id = pad_id

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The model's own loss of predicting `labels` from `input_ids`."""
        if self.masked:
            return self.model(input_ids=input_ids, labels=labels,
                              attention_mask=self.attention_mask(input_ids)).loss
        if position_ids is not None:
            return self.model(input_ids=input_ids, labels=labels, position_ids=position_ids).loss
        return self.model(input_ids=input_ids, labels=labels).loss

    def attention_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 where the encoder attends: every token but padding."""
        if self.pad_id < 0:
            return torch.ones_like(input_ids)
        return (input_ids != self.pad_id).to(input_ids.dtype)


def sizes() -> tuple[str, ...]:
    return tuple(_SIZES)


def preset(model_type: str, size: str) -> dict:
    """The ModelConfig fields of `size` for `hf:<model_type>`."""
    if size not in _SIZES:
        raise ConfigError(f"unknown size {size!r} for {PREFIX}{model_type}: choose one of "
                          f"{', '.join(_SIZES)}")
    layers, heads, hidden, seq_len, vocab = _SIZES[size]
    return dict(layers=layers, heads=heads, hidden=hidden, seq_len=seq_len, vocab=vocab,
                tie_embeddings=_tied_by_default(model_type))


@lru_cache(maxsize=64)
def _tied_by_default(model_type: str) -> bool:
    """The config class's own `tie_word_embeddings` (GPT-2, BERT, T5: tied)."""
    mapping = _transformers().CONFIG_MAPPING
    try:
        return model_type in mapping and bool(getattr(mapping[model_type](),
                                                      "tie_word_embeddings", False))
    except Exception:  # noqa: BLE001 - a config that will not build says so in hf_config
        return False


def _transformers():
    try:
        import transformers  # optional
    except ImportError:
        raise ConfigError("Hugging Face models need transformers: pip install -e '.[hf]'") \
            from None
    transformers.logging.set_verbosity_error()  # its advice on configs would bury our one line
    return transformers


CONFIG_FILE = "config.json"  # transformers' config in a save_pretrained directory
_SIZE_FIELDS = {"layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                           "encoder_layers", "decoder_layers", "block_sizes",
                           "layers_block_type"),
                "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads",
                          "attention_heads", "encoder_attention_heads",
                          "decoder_attention_heads"),
                "hidden": ("hidden_size", "n_embd", "d_model", "dim", "emb_dim"),
                "vocab": ("vocab_size",)}
_POSITIONS = ("max_position_embeddings", "n_positions")


def saved_config(path: str) -> dict:
    """The config.json of the `save_pretrained` directory `path` (one line
    if there is none, or it is not JSON)."""
    file = Path(path) / CONFIG_FILE
    try:
        conf = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: cannot read it as transformers' config ({e}); give a "
                          "directory written by save_pretrained") from None
    if not isinstance(conf, dict) or "model_type" not in conf:
        raise ConfigError(f"{file} has no model_type; give a directory written by "
                          "save_pretrained")
    return conf


def _saved_size(conf: dict, names: tuple[str, ...]) -> tuple[str, int] | None:
    """(name, value) of the first of `names` a saved config sets to an
    integer (or a list: of block sizes, summed, funnel's; of layer kinds,
    counted, nemotron_h's): its own fields first, then its text
    sub-config's (a multimodal model's `text_config`), then any other
    sub-config's; None if none does."""
    subs = [conf, conf.get("text_config")] + [v for k, v in conf.items() if k != "text_config"
                                              and isinstance(v, dict) and "model_type" in v]
    for sub in (s for s in subs if isinstance(s, dict)):
        for name in names:
            value = sub.get(name)
            if isinstance(value, list) and value:
                value = sum(value) if all(isinstance(v, int) for v in value) else len(value)
            if isinstance(value, int) and not isinstance(value, bool):
                return name, value
    return None


def saved_fields(path: str, model: str, size: str, given: dict) -> dict:
    """The ModelConfig fields of the model saved in `path`: sizes from its
    config.json; `given` sizes must agree with it; `model` ("hf:" alone, or
    `hf:<type>` to check) names its type."""
    conf = saved_config(path)
    kind = PREFIX + conf["model_type"]
    if model not in (PREFIX, kind):
        raise ConfigError(f"--init-from {path} holds a {conf['model_type']} model, not "
                          f"{model.removeprefix(PREFIX)}; leave --hf out (the directory's "
                          "config says what the model is)")
    sizes = {}
    for key, names in _SIZE_FIELDS.items():
        found = _saved_size(conf, names)
        if found is None:
            raise ConfigError(f"{Path(path) / CONFIG_FILE} has no {' or '.join(names)}; "
                              "meshplan reads a transformer's sizes from it")
        name, sizes[key] = found
        if given.get(key, sizes[key]) != sizes[key]:
            raise ConfigError(f"--{key} {given[key]} differs from {name} {sizes[key]} in "
                              f"{Path(path) / CONFIG_FILE}; leave --{key} out (the saved "
                              "model's own size is used)")
    longest = (_saved_size(conf, _POSITIONS) or (None, None))[1]
    seq_len = given.get("seq_len") or preset(conf["model_type"], size)["seq_len"]
    if longest is not None:
        for key in ("seq_len", "target_len"):
            if given.get(key, 0) > longest:
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"{flag} {given[key]} is longer than the saved model's "
                                  f"{longest} positions; give {flag} {longest} or less")
        seq_len = min(seq_len, longest)
    tied = bool(conf.get("tie_word_embeddings", _tied_by_default(conf["model_type"])))
    if given.get("tie_embeddings", tied) != tied:
        raise ConfigError(f"--tie-embeddings differs from the saved model's "
                          f"tie_word_embeddings {tied}; leave it out")
    return {"model": kind, "seq_len": seq_len, "tie_embeddings": tied,
            "source": str(Path(path).resolve()), "target_len": given.get("target_len", 0),
            **sizes}


def hf_config(cfg):
    """The transformers config of `cfg` (a ModelConfig named `hf:<type>`):
    built from our sizes, or the one saved in `cfg.source` (its dropouts
    `cfg.dropout`, 0 unless asked)."""
    tf = _transformers()
    if cfg.source:
        conf = tf.AutoConfig.from_pretrained(cfg.source)
        for name, v in _dropouts(conf, cfg).items():
            setattr(conf, name, v)
        return conf
    model_type = cfg.model.removeprefix(PREFIX)
    if model_type not in tf.CONFIG_MAPPING:
        raise ConfigError(f"transformers {tf.__version__} has no model_type {model_type!r}; "
                          f"tested: {', '.join(TESTED[:3])}, ... (README)")
    cls = tf.CONFIG_MAPPING[model_type]
    try:
        return cls(**hf_sizes.quirks(model_type, _fields(cls(), cfg), cfg))
    except Exception as e:  # noqa: BLE001 - one line for any config that will not take ours
        raise _unbuildable(cfg, e) from None


def _unbuildable(cfg, e: Exception) -> ConfigError:
    text = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
    return ConfigError(f"cannot build {cfg.model} offline from its config "
                       f"({type(e).__name__}: {text}); use a causal-LM, masked-LM or "
                       f"encoder-decoder model_type, e.g. {', '.join(TESTED[:3])}")


def _fields(probe, cfg) -> dict:
    """Our sizes under the config class's own names."""
    kw = {}
    for names, value in ((("num_hidden_layers", "n_layer"), cfg.layers),
                         (("num_attention_heads", "n_head"), cfg.heads),
                         (("hidden_size", "n_embd"), cfg.hidden),
                         (("max_position_embeddings", "n_positions"),
                          max(cfg.seq_len, cfg.target_len)),
                         (("vocab_size",), cfg.vocab)):
        name = next((n for n in names if hasattr(probe, n)), names[0])
        # under the field's own name: an alias is set after __post_init__ derives from it
        name = getattr(probe, "attribute_map", {}).get(name, name)  # (DBRX's experts' width)
        if hf_sizes.settable(probe, name):  # else derived from fields sized below
            kw[name] = value
    if getattr(probe, "is_encoder_decoder", False):  # the encoder and the decoder alike
        for stacks, value in (
                (("encoder_layers", "decoder_layers", "num_layers", "num_encoder_layers",
                  "num_decoder_layers"), cfg.layers),
                (("encoder_attention_heads", "decoder_attention_heads", "num_heads",
                  "num_encoder_attention_heads", "num_decoder_attention_heads"), cfg.heads),
                (("encoder_ffn_dim", "decoder_ffn_dim", "d_ff"), 4 * cfg.hidden),
                (("d_model",), cfg.hidden), (("d_kv",), cfg.hidden // cfg.heads)):
            kw.update({n: value for n in stacks if hasattr(probe, n)})
        if getattr(probe, "decoder_start_token_id", None) is None:  # T5: the decoder starts
            kw["decoder_start_token_id"] = getattr(probe, "pad_token_id", None) or 0  # at pad
        if getattr(probe, "pad_token_id", 0) is None:  # EncoderDecoderModel's: what shifting
            kw["pad_token_id"] = 0  # the labels right needs, as the start token above
    for name, v in vars(probe).items():  # head and MLP widths, under their many names
        if isinstance(v, int) and not isinstance(v, bool) or v is None and \
                name in ("head_dim", *_EXPERTS):
            width = _width(name, v, probe, cfg)
            if width is not None:
                kw[name] = width
    if hasattr(probe, "num_key_value_heads"):  # grouped-query attention, but for
        # multi-head latent attention (DeepSeek's), whose keys have every head
        kw["num_key_value_heads"] = cfg.heads if hasattr(probe, "kv_lora_rank") else \
            max(1, cfg.heads // 2)
    kw.update(_dropouts(probe, cfg))
    kw["tie_word_embeddings"] = cfg.tie_embeddings
    kw.update(_per_layer(probe, cfg.layers))
    kw.update(hf_sizes.fields(probe, cfg))
    base = _transformers().PreTrainedConfig
    for name, sub in vars(probe).items():  # gemma3's text_config, t5gemma's encoder, ...
        if isinstance(sub, base):
            kw[name] = hf_sizes.sub_dict(sub) | _fields(sub, cfg)
    for token in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if isinstance(getattr(probe, token, None), int) and getattr(probe, token) >= cfg.vocab:
            kw[token] = cfg.vocab - 1
    if isinstance(getattr(probe, "rotary_dim", None), int):  # rotary on part of each head
        kw["rotary_dim"] = _rotary_dim(probe, cfg)
    pad = kw.get("pad_token_id", getattr(probe, "pad_token_id", None))
    if _positions_after_padding(cfg.model.removeprefix(PREFIX)):
        if pad is None:  # ESM's config leaves it to the checkpoint, whose pad is 1
            pad = kw["pad_token_id"] = 1
        # RoBERTa-style position ids start at pad + 1: the table needs that many rows more
        pos = next(n for n in ("max_position_embeddings", "n_positions") if n in kw)
        kw[pos] = cfg.seq_len + pad + 1
    return kw


def _dropouts(conf, cfg) -> dict:
    """Every dropout field of `conf`, whatever its name, at `cfg.dropout`;
    every LayerDrop (`encoder_layerdrop`, ...) at 0: skipping a whole layer
    at random is a branch on a tensor's value, which no static plan holds."""
    return {d: 0.0 if d.endswith("layerdrop") else cfg.dropout
            for d, v in conf.to_dict().items() if isinstance(v, float)
            and ("dropout" in d or d.endswith("pdrop") or d.endswith("layerdrop"))}


def experts_of(module: nn.Module) -> tuple[int, int] | None:
    """(experts per layer, experts a token takes) of a transformers mixture of
    experts built here (`HFLoss`), from its config; None for a dense model."""
    conf = getattr(getattr(module, "model", None), "config", None)

    def first(names) -> int | None:
        return next((v for n in names if isinstance(v := getattr(conf, n, None), int)), None)

    experts, top_k = first(_EXPERT_COUNTS), first(_EXPERTS_PER_TOKEN)
    return (experts, top_k) if experts and top_k else None


def _has_experts(probe) -> bool:
    """A mixture of experts whose config leaves a count to the checkpoint:
    DeepSeek-V2's experts per token, dots1's experts too (its experts' own
    width, `moe_intermediate_size`, says it has them)."""
    return hasattr(probe, "moe_intermediate_size") or any(
        isinstance(getattr(probe, n, None), int) and getattr(probe, n) > 0
        for n in _EXPERT_COUNTS)


def _width(name: str, v: int | None, probe, cfg) -> int | None:
    """Our size for the config's integer field `name` (default `v`), or None
    to leave it: heads, MLP widths, multi-head latent attention (DeepSeek's
    ranks and its rotary part of a head), experts, vocabularies."""
    head = cfg.hidden // cfg.heads
    if name == "head_dim":
        if hasattr(probe, "qk_rope_head_dim"):  # MLA derives it, but for longcat_flash's,
            return head // 2 if v == probe.qk_rope_head_dim else None  # its rotary part
        return head
    if "intermediate_size" in name:
        return 4 * cfg.hidden
    if name.endswith("lora_rank"):
        return cfg.hidden // 2
    if name in ("qk_rope_head_dim", "qk_nope_head_dim"):
        return head // 2
    if name in ("v_head_dim", "qk_head_dim"):
        return head
    if name in _EXPERTS and v is not None and name != "n_shared_experts":  # as many as given
        return min(v, _EXPERTS[name])
    if name in _EXPERTS and v is None and _has_experts(probe):  # left to the checkpoint
        return _EXPERTS[name]
    if name.endswith("vocab_size") or name.startswith("vocab_size"):
        return cfg.vocab  # fsmt's src_vocab_size, gemma3n's per-layer vocabulary
    return hf_sizes.width(name, v, probe, cfg)


def _per_layer(probe, layers: int) -> dict:
    """The config's lists with one entry per layer (layer types, sparsity
    patterns), resampled evenly to `layers` entries so that the first and the
    last kind are kept; dicts keyed by layer index keep the keys below it."""
    n = getattr(probe, "num_hidden_layers", None)
    if not isinstance(n, int) or n == layers:
        return {}
    out: dict = {}
    for name, v in vars(probe).items():
        if isinstance(v, (list, tuple)) and len(v) == n and n > 1 and not hf_sizes.index_list(v):
            out[name] = type(v)(v[round(i * (n - 1) / max(1, layers - 1))]
                                for i in range(layers))
        elif isinstance(v, dict) and v and all(isinstance(k, int) for k in v):
            out[name] = {k: x for k, x in v.items() if k < layers}
    return out


def _rotary_dim(probe, cfg) -> int:
    """The default config's fraction of a head that is rotated (GPT-J: 64 of
    256), of our head size, even and at least 2."""
    heads = next(getattr(probe, n) for n in ("num_attention_heads", "n_head") if hasattr(probe, n))
    hidden = next(getattr(probe, n) for n in ("hidden_size", "n_embd") if hasattr(probe, n))
    head = cfg.hidden // cfg.heads
    return max(2, min(head, head * probe.rotary_dim // (hidden // heads)) // 2 * 2)


@lru_cache(maxsize=64)
def _positions_after_padding(model_type: str) -> bool:
    """Whether the model numbers positions from its padding index on
    (transformers' `create_position_ids_from_input_ids`: RoBERTa, XLM-R, ...)."""

    from transformers.models.auto.configuration_auto import model_type_to_module_name  # optional

    name = model_type_to_module_name(model_type)
    mods = []  # a package may hold several models: data2vec's modeling_data2vec_text
    for file in dict.fromkeys((name, model_type.replace("-", "_"))):
        try:
            mods.append(importlib.import_module(f"transformers.models.{name}.modeling_{file}"))
        except ImportError:
            continue
    return any(hasattr(x, "create_position_ids_from_input_ids")
               for mod in mods
               for x in (mod, *(v for v in vars(mod).values() if inspect.isclass(v))))


@lru_cache(maxsize=16)
def task_of(cfg) -> str:
    """What `cfg`'s model is trained to do: CAUSAL, MASKED or SEQ2SEQ."""
    conf = hf_config(cfg)
    saved = _saved_class(conf) if cfg.source else None
    if saved is not None:
        return _task_of_class(saved.__name__)
    return _task(cfg.model.removeprefix(PREFIX), type(conf))


def _saved_class(conf):
    """The class a saved config's `architectures` names, when no Auto class
    of a language model maps its config type (the causal LM of a multimodal
    type: `MllamaForCausalLM` over `MllamaTextConfig`, as an export of
    `--hf mllama` writes it); else None."""
    tf = _transformers()
    if any(type(conf) in _auto_for(t)._model_mapping for t in (CAUSAL, MASKED, SEQ2SEQ)):
        return None
    for name in getattr(conf, "architectures", None) or ():
        cls = getattr(tf, name, None)
        if getattr(cls, "config_class", None) is type(conf) and _task_of_class(name):
            return cls
    return None


def _task_of_class(name: str) -> str:
    """The task whose Auto class lists the class `name` ("" if none does)."""
    from transformers.models.auto import modeling_auto as m  # optional: transformers

    for task, names in ((SEQ2SEQ, m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                        (CAUSAL, m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                        (MASKED, m.MODEL_FOR_MASKED_LM_MAPPING_NAMES)):
        if any(name == v or (isinstance(v, tuple) and name in v) for v in names.values()):
            return task
    return ""


def _task(model_type: str, conf_type) -> str:
    tf = _transformers()
    if model_type in ENCODERS:
        return MASKED
    if conf_type in tf.AutoModelForSeq2SeqLM._model_mapping:
        return SEQ2SEQ
    return CAUSAL if conf_type in tf.AutoModelForCausalLM._model_mapping else MASKED


def _auto_for(task: str):
    tf = _transformers()
    return {CAUSAL: tf.AutoModelForCausalLM, MASKED: tf.AutoModelForMaskedLM,
            SEQ2SEQ: tf.AutoModelForSeq2SeqLM}[task]


def _model_class(cfg, conf):
    """The transformers class that `cfg`'s model is (`conf`: its config):
    a saved model's own (`_saved_class`), or the one the Auto class of its
    task maps its config type to; None if there is none."""
    saved = _saved_class(conf) if cfg.source else None
    return saved or _auto_for(task_of(cfg))._model_mapping.get(type(conf), None)


def meta_model(config: dict, architecture: str = "") -> nn.Module:
    """The transformers model (no `HFLoss` around it) of a config dict (a
    record's `hf_config`, `to_json_string()`'s form: a non-finite float is
    `{"__float__": "Infinity"}`), built on the meta device as the class
    `architecture` (a record's), or else for the task `task_of` trains its
    type as: its names, shapes and tying."""
    tf = _transformers()
    model_type = config.get("model_type", "")
    cls = getattr(tf, architecture, None) if architecture else None
    if model_type not in tf.CONFIG_MAPPING or (architecture and cls is None):
        raise ConfigError(f"transformers {tf.__version__} has no model_type {model_type!r} "
                          f"({architecture or 'no class recorded'}); export it with "
                          "--format torch")
    conf = tf.CONFIG_MAPPING[model_type].from_dict(_special_floats(config))
    with torch.device("meta"):
        if cls is not None:
            return cls._from_config(conf)
        return _auto_for(_task(model_type, type(conf))).from_config(conf)


def _special_floats(obj):
    """`obj` with transformers' JSON form of a non-finite float
    (`{"__float__": "NaN" | "Infinity" | "-Infinity"}`) made a float again."""
    if isinstance(obj, dict):
        if obj.keys() == {"__float__"}:
            return float(obj["__float__"])
        return {k: _special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_special_floats(v) for v in obj]
    return obj


def build_hf(cfg) -> nn.Module:
    """`HFLoss` around a random `cfg` model (on the current default device)."""
    conf = hf_config(cfg)
    conf.use_cache = False  # a training step keeps no KV cache (its update detaches in place)
    saved = _saved_class(conf) if cfg.source else None
    auto = _auto_for(task_of(cfg))
    if saved is None and type(conf) not in auto._model_mapping:
        raise ConfigError(f"cannot build {cfg.model}: transformers has no causal-LM, "
                          f"masked-LM or encoder-decoder LM for it; use e.g. "
                          f"{', '.join(TESTED[:3])}")
    build = saved._from_config if saved is not None else auto.from_config
    try:
        if torch.empty(0).device.type != "meta":
            with torch.device("meta"):  # a field left at its full size: one line, no OOM
                _check_size(cfg, build(conf, attn_implementation=attention_of(cfg)))
        model = build(conf, attn_implementation=attention_of(cfg))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - one line for any type that will not build
        raise _unbuildable(cfg, e) from None
    return HFLoss(model, masked=encoder_decoder(cfg), pad_id=cfg.pad_id).train()


def encoder_decoder(cfg) -> bool:
    """Whether `cfg`'s model encodes its inputs and decodes its labels (its
    config's `is_encoder_decoder`): T5, BART, ..., not the speech models that
    transformers lists as sequence-to-sequence, which decode one stream of
    input ids (audio placed among them) and take labels aligned to it."""
    return bool(getattr(hf_config(cfg), "is_encoder_decoder", False))


def _check_size(cfg, model: nn.Module) -> None:
    """Refuse a model far larger than its sizes make a transformer (a config
    field that does not follow them, e.g. a vision tower's own width)."""
    expect = 12 * cfg.layers * cfg.hidden ** 2 + (2 * cfg.vocab + cfg.seq_len) * cfg.hidden
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    if total > TOO_LARGE * expect:
        name, p = max(params.items(), key=lambda kv: kv[1].numel())
        raise ConfigError(f"cannot build {cfg.model} at these sizes: its config gives "
                          f"{total / 1e6:.1f}M parameters, over {TOO_LARGE}x the "
                          f"{expect / 1e6:.2f}M of a transformer of --layers {cfg.layers} "
                          f"--hidden {cfg.hidden}; the largest, {name} {list(p.shape)}, "
                          f"comes from a config field meshplan does not size")


@lru_cache(maxsize=16)
def attention_of(cfg) -> str:
    """The attention implementation a model is built with: "sdpa" (one
    fused op, torch's flash kernels), else "eager" (transformers' own
    matmul, softmax, matmul) for a type with no SDPA kernel (bloom, ...)."""
    cls = _model_class(cfg, hf_config(cfg))
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"


def packed_positions(seq_len: int, batch_size: int) -> torch.Tensor:
    """Position ids of packed rows for a model's example batch: two pairs a
    row, the second from a third of it on."""
    cut = seq_len // 3
    pos = torch.arange(seq_len).repeat(batch_size, 1)
    return torch.where(pos < cut, pos, pos - cut)


def hf_batch(cfg, batch_size: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(input_ids, labels): next-token data for a causal LM (`packed`: and
    position ids of two pairs a row); masked tokens (15%, id 0) for a
    masked LM, labelled only where masked, and for an encoder-decoder,
    which reconstructs the whole sequence (with a `target_len` of its own,
    learns random tokens of that length)."""
    ids = torch.randint(1, cfg.vocab, (batch_size, cfg.seq_len), generator=gen)
    task = task_of(cfg)
    if task == CAUSAL and cfg.packed:
        return ids, ids.clone(), packed_positions(cfg.seq_len, batch_size)
    if task == CAUSAL:
        return ids, ids.clone()
    mask = torch.rand(batch_size, cfg.seq_len, generator=gen) < 0.15
    mask[:, 0] = True  # every row predicts at least one token
    masked = torch.where(mask, torch.zeros_like(ids), ids)
    if task == SEQ2SEQ and cfg.target_len:
        return masked, torch.randint(1, cfg.vocab, (batch_size, cfg.target_len), generator=gen)
    return masked, ids.clone() if task == SEQ2SEQ else torch.where(mask, ids, -100)
