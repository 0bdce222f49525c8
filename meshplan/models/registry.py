"""Model registry: presets, validated configs, builders and example batches.

Invariants:
- `model_config` is the only way user input becomes a `ModelConfig`, and it
  either returns a config every builder accepts or raises `ConfigError` with
  one line saying what is wrong, where and how to fix it.
- Every model's forward takes the tensors of `example_batch` positionally
  and returns a scalar loss; its repeated layers live in `blocks.{i}`, which
  `layer_pattern` matches.
- `example_batch` is a pure function of (cfg, batch_size, seed): data is
  drawn on CPU from a private `torch.Generator`, so it is the same on every
  rank and device and never touches the global RNG.
- `hf:<model_type>` names a transformers model (models/hf.py) with the
  transformer fields; its layer pattern and tp plan are derived from the
  module (`passes/derive.py`).
- For resnet, `layers == sum(blocks)` and `hidden == width`; `heads=1`,
  `seq_len=0` and `vocab=0` are placeholders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from meshplan.errors import ConfigError
from meshplan.models import hf
from meshplan.models.bert import BERT, mlm_batch
from meshplan.models.data import class_images, markov_tokens
from meshplan.models.gpt import GPT
from meshplan.models.moe import MoEGPT, active_numel
from meshplan.models.resnet import STAGE_STRIDES, ResNet

MODELS = ("gpt", "bert", "resnet", "moe")
LAYER_PATTERN = r"blocks\.(\d+)"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of one model; resnet-only fields are 0/() elsewhere."""

    model: str
    layers: int
    heads: int
    hidden: int
    seq_len: int
    vocab: int
    dropout: float = 0.0
    image_size: int = 0
    width: int = 0
    num_classes: int = 0
    blocks: tuple[int, ...] = ()
    tie_embeddings: bool = False  # gpt: the head's weight is the token embedding's
    experts: int = 0  # moe: experts per block
    top_k: int = 0  # moe: experts each token takes
    capacity_factor: float | None = None  # moe: None = dropless (models/moe.py)
    source: str = ""  # hf: a `save_pretrained` directory whose config.json is the model's
    pad_id: int = -1  # hf encoder-decoder on pairs: the id sources are padded with, -1: none
    target_len: int = 0  # hf encoder-decoder: its labels' length (the decoder's); 0: seq_len
    packed: bool = False  # hf causal LM: its batch has position ids restarting at each pair


def _transformer(model: str, layers: int, heads: int, hidden: int,
                 seq_len: int, vocab: int) -> ModelConfig:
    return ModelConfig(model, layers, heads, hidden, seq_len, vocab)


def _resnet(blocks: tuple[int, ...], width: int, image_size: int,
            num_classes: int) -> ModelConfig:
    return ModelConfig(
        "resnet", layers=sum(blocks), heads=1, hidden=width, seq_len=0, vocab=0,
        image_size=image_size, width=width, num_classes=num_classes, blocks=blocks,
    )


PRESETS: dict[str, dict[str, ModelConfig]] = {
    "gpt": {
        "tiny": _transformer("gpt", 4, 4, 64, 16, 128),
        "small": _transformer("gpt", 8, 8, 256, 128, 1024),
        "gpt3-175b": _transformer("gpt", 96, 96, 12288, 2048, 50304),
        # 36 layers 4096 wide: 8.2B parameters at seq 131072 (its learned positions
        # are 0.5B of them), the long-context search's model (docs/concepts/long_context.md)
        "8b": _transformer("gpt", 36, 32, 4096, 8192, 50304),
        # Llama 3 405B's depth, width, heads, context and vocabulary with the zoo's
        # blocks (a 4x GELU MLP for its SwiGLU, no grouped-query attention): 410B
        # parameters, the compile-scaling benchmark's 16,384-GPU model
        "405b": _transformer("gpt", 126, 128, 16384, 8192, 128256),
    },
    "bert": {
        "tiny": _transformer("bert", 4, 4, 64, 16, 128),
        "small": _transformer("bert", 8, 8, 256, 128, 1024),
        "bert-large": _transformer("bert", 24, 16, 1024, 512, 30522),
    },
    "moe": {
        "tiny": replace(_transformer("moe", 4, 4, 64, 16, 128), experts=4, top_k=2),
        "small": replace(_transformer("moe", 8, 8, 256, 128, 1024), experts=8, top_k=2),
        # Mixtral 8x7B's shape (its 32 layers, 4096 wide, 8 experts, 2 per token,
        # 32k vocabulary, 4k context), with the zoo's experts (a GELU MLP of two
        # 4096 x 16384 matrices, where Mixtral's SwiGLU has three 4096 x 14336)
        # and no grouped-query attention: 36.8B parameters to its 46.7B
        "mixtral-8x7b": replace(_transformer("moe", 32, 32, 4096, 4096, 32000), experts=8,
                                top_k=2),
    },
    "resnet": {
        "tiny": _resnet((1, 1, 1, 1), width=8, image_size=16, num_classes=10),
        "small": _resnet((2, 2, 2, 2), width=16, image_size=32, num_classes=10),
        "resnet50": _resnet((3, 4, 6, 3), width=64, image_size=224, num_classes=1000),
    },
}

# Which override names make sense per family. Resnet's depth comes from
# `blocks`, and it has no heads, sequence or vocabulary, so those flags would
# be silently meaningless there; reject them instead.
_TRANSFORMER_KEYS = frozenset({"layers", "heads", "hidden", "seq_len", "vocab", "dropout"})
_RESNET_KEYS = frozenset({"hidden", "width", "image_size", "num_classes", "blocks"})
_GPT_KEYS = _TRANSFORMER_KEYS | {"tie_embeddings"}
_HF_KEYS = _GPT_KEYS | {"target_len", "packed"}
_MOE_KEYS = (_TRANSFORMER_KEYS - {"dropout"}) | {"experts", "top_k", "capacity_factor"}
_ALLOWED = {"gpt": _GPT_KEYS | {"packed"}, "bert": _TRANSFORMER_KEYS, "resnet": _RESNET_KEYS,
            "moe": _MOE_KEYS | {"packed"}}


def _choices(names) -> str:
    return ", ".join(names)


def model_config(model: str, size: str = "tiny", **overrides) -> ModelConfig:
    """Return the `size` preset of `model` with `overrides` applied, validated.

    Overrides are `ModelConfig` field names (`layers`, `heads`, `hidden`,
    `seq_len`, `vocab`, `dropout`, for gpt `tie_embeddings`; for resnet `hidden`/`width`,
    `image_size`, `num_classes`, `blocks`); `None` values are ignored so CLI
    flags can be passed straight through. Raises `ConfigError`.
    """
    if model.startswith(hf.PREFIX):
        return _hf_config(model, size, overrides)
    if model not in PRESETS:
        raise ConfigError(f"unknown model {model!r}: choose one of {_choices(MODELS)}, "
                          "or hf:<model_type> (--hf) for a transformers model")
    presets = PRESETS[model]
    if size not in presets:
        raise ConfigError(
            f"unknown size {size!r} for {model}: choose one of {_choices(presets)}"
        )
    given = {k: v for k, v in overrides.items() if v is not None}
    allowed = _ALLOWED[model]
    for key in given:
        if key == "packed" and key not in allowed:
            raise ConfigError(f"--pack packs pairs into the rows of a causal LM (--model gpt "
                              f"or moe, or a transformers one: --hf TYPE); {model} is not one: "
                              "leave --pack out")
        if key not in allowed:
            raise ConfigError(
                f"{model}: override {key!r} does not apply to {model}; "
                f"use only {_choices(sorted(allowed))}"
            )
    if model == "resnet":
        given = _resnet_overrides(given)
    cfg = replace(presets[size], **given)
    validate(cfg)
    return cfg


def _hf_config(model: str, size: str, overrides: dict) -> ModelConfig:
    given = {k: v for k, v in overrides.items() if v is not None}
    source = given.pop("source", "")
    pad = {"pad_id": given.pop("pad_id")} if "pad_id" in given else {}  # set by the data
    if source:
        cfg = ModelConfig(**hf.saved_fields(source, model, size, given), **pad)
    else:
        bad = sorted(set(given) - _HF_KEYS)
        if bad:
            raise ConfigError(f"{model}: override {bad[0]!r} does not apply; use only "
                              f"{_choices(sorted(_HF_KEYS))}")
        cfg = ModelConfig(model, **(hf.preset(model.removeprefix(hf.PREFIX), size) | given | pad))
        validate(cfg)
        hf.hf_config(cfg)  # an unknown model_type, or no transformers: one line now
    if cfg.target_len and not hf.encoder_decoder(cfg):
        raise ConfigError(f"--target-len sets an encoder-decoder's target length; {cfg.model} "
                          "is not one (its labels are as long as its inputs): leave it out")
    if cfg.packed and hf.task_of(cfg) != hf.CAUSAL:
        raise ConfigError(f"--pack packs pairs into a causal LM's rows; {cfg.model} is "
                          f"{'an encoder-decoder' if hf.encoder_decoder(cfg) else 'not one'}: "
                          "leave --pack out")
    return cfg


def _resnet_overrides(given: dict) -> dict:
    # `hidden` is resnet's base width; keep the two fields in step, and keep
    # `layers` equal to the total number of blocks.
    if "hidden" in given and "width" in given and given["hidden"] != given["width"]:
        raise ConfigError(
            f"resnet: hidden={given['hidden']} and width={given['width']} disagree; "
            "pass only one of them"
        )
    width = given.pop("hidden", given.get("width"))
    if width is not None:
        given["width"] = given["hidden"] = width
    if "blocks" in given:
        given["blocks"] = tuple(given["blocks"])
        given["layers"] = sum(given["blocks"])
    return given


def validate(cfg: ModelConfig) -> None:
    """Raise `ConfigError` if `cfg` cannot be built; return None otherwise."""
    if cfg.model not in PRESETS and not cfg.model.startswith(hf.PREFIX):
        raise ConfigError(f"unknown model {cfg.model!r}: choose one of {_choices(MODELS)}")
    if cfg.model == "resnet":
        _validate_resnet(cfg)
        return
    for name in ("layers", "heads", "hidden", "seq_len", "vocab"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{cfg.model}: {name}={value!r} must be a positive integer")
    if cfg.hidden % cfg.heads:
        divisors = [d for d in range(1, cfg.hidden + 1) if cfg.hidden % d == 0]
        raise ConfigError(
            f"{cfg.model}: heads={cfg.heads} does not divide hidden={cfg.hidden}; "
            f"pick heads among {_choices(map(str, divisors))}"
        )
    if cfg.model == "bert" and cfg.vocab < 2:
        # Id 0 is [MASK]; real tokens need at least one more id.
        raise ConfigError(f"bert: vocab={cfg.vocab} is too small; use vocab >= 2")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"{cfg.model}: dropout={cfg.dropout} must be in [0, 1)")
    if not isinstance(cfg.target_len, int) or cfg.target_len < 0:
        raise ConfigError(f"{cfg.model}: target_len={cfg.target_len!r} must be a positive "
                          "integer (--target-len)")
    if cfg.model == "moe":
        _validate_moe(cfg)


def _validate_moe(cfg: ModelConfig) -> None:
    if not isinstance(cfg.experts, int) or cfg.experts < 1:
        raise ConfigError(f"moe: experts={cfg.experts!r} must be a positive integer (--experts)")
    if not isinstance(cfg.top_k, int) or not 1 <= cfg.top_k <= cfg.experts:
        raise ConfigError(f"moe: top_k={cfg.top_k!r} must be 1 to the {cfg.experts} experts "
                          "(--top-k)")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        raise ConfigError(f"moe: capacity_factor={cfg.capacity_factor!r} must be above 0 "
                          "(--capacity-factor; leave it out for dropless)")
    if cfg.packed and cfg.capacity_factor is not None:
        raise ConfigError(f"--pack with --capacity-factor {cfg.capacity_factor:g}: an expert's "
                          "slots are a row's, so one pair's tokens would take them from the "
                          "others of its row; leave --capacity-factor out (dropless) to pack")


def _validate_resnet(cfg: ModelConfig) -> None:
    for name in ("width", "image_size", "num_classes"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"resnet: {name}={value!r} must be a positive integer")
    stages = len(STAGE_STRIDES)
    if not 1 <= len(cfg.blocks) <= stages or any(
        not isinstance(b, int) or b <= 0 for b in cfg.blocks
    ):
        raise ConfigError(
            f"resnet: blocks={cfg.blocks!r} must be 1 to {stages} positive integers, "
            "e.g. (3, 4, 6, 3)"
        )


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> nn.Module:
    """Construct the model for `cfg` on `device`, in train mode.

    With `device="meta"` no storage is allocated (and init is skipped), so
    even GPT-3 175B builds in about a second, for planning and cost models.
    """
    validate(cfg)
    with torch.device(device):
        if cfg.model == "gpt":
            return GPT(cfg.layers, cfg.heads, cfg.hidden, cfg.seq_len, cfg.vocab, cfg.dropout,
                       cfg.tie_embeddings)
        if cfg.model == "moe":
            return MoEGPT(cfg.layers, cfg.heads, cfg.hidden, cfg.seq_len, cfg.vocab,
                          cfg.experts, cfg.top_k, cfg.capacity_factor)
        if cfg.model == "bert":
            return BERT(cfg.layers, cfg.heads, cfg.hidden, cfg.seq_len, cfg.vocab, cfg.dropout)
        if cfg.model.startswith(hf.PREFIX):
            return hf.build_hf(cfg)
        return ResNet(cfg.blocks, cfg.width, cfg.image_size, cfg.num_classes)


def example_batch(
    cfg: ModelConfig, batch_size: int, seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, ...]:
    """Return the forward inputs of `cfg`'s model for `batch_size` samples.

    gpt, moe: (tokens, targets) long (B, T); targets are tokens shifted by one.
    bert: (masked tokens, labels) long (B, T); labels -100 where unmasked.
    resnet: (images float32 (B, 3, S, S), labels long (B,)).
    Tokens and images come from a learnable task (`models/data.py`).
    Deterministic in `seed`; on meta, empty tensors of the same shape/dtype.
    """
    if batch_size <= 0:
        raise ConfigError(f"{cfg.model}: batch_size={batch_size} must be a positive integer")
    validate(cfg)
    device = torch.device(device)
    if device.type == "meta":
        return tuple(torch.empty(shape, dtype=dtype, device=device)
                     for shape, dtype in batch_spec(cfg, batch_size))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if cfg.model in ("gpt", "moe"):
        # One (T + 1)-long stream per row gives consistent next-token targets.
        stream = markov_tokens(cfg.vocab, batch_size, cfg.seq_len + 1, gen)
        batch = (stream[:, :-1].contiguous(), stream[:, 1:].contiguous(),
                 *([hf.packed_positions(cfg.seq_len, batch_size)] if cfg.packed else []))
    elif cfg.model == "bert":
        tokens = markov_tokens(cfg.vocab, batch_size, cfg.seq_len, gen)
        batch = mlm_batch(tokens, gen)
    elif cfg.model.startswith(hf.PREFIX):
        batch = hf.hf_batch(cfg, batch_size, gen)
    else:
        batch = class_images(cfg.num_classes, cfg.image_size, batch_size, gen)
    return tuple(t.to(device) for t in batch)


def batch_spec(
    cfg: ModelConfig, batch_size: int,
) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Return (shape, dtype) of each forward input, without making tensors."""
    if cfg.model == "resnet":
        size = cfg.image_size
        return ((batch_size, 3, size, size), torch.float32), ((batch_size,), torch.long)
    shape = (batch_size, cfg.seq_len)
    return ((shape, torch.long), ((batch_size, cfg.target_len or cfg.seq_len), torch.long),
            *([(shape, torch.long)] if cfg.packed else []))


def layer_pattern(cfg: ModelConfig) -> str:
    """Regex over module paths whose group(1) is a layer index (`blocks.3`);
    "" for a transformers model (its layers are derived from the module at
    capture: `passes/derive.py`)."""
    return "" if cfg.model.startswith(hf.PREFIX) else LAYER_PATTERN


def param_count(model: nn.Module) -> int:
    """Number of parameter elements (works on meta models)."""
    return sum(math.prod(p.shape) for p in model.parameters())


def active_param_count(cfg: ModelConfig, model: nn.Module) -> int | None:
    """Parameter elements one token uses, for a mixture of experts (the zoo's
    or a transformers one); None for a dense model."""
    moe = (cfg.experts, cfg.top_k) if cfg.model == "moe" else \
        hf.experts_of(model) if cfg.model.startswith(hf.PREFIX) else None
    return None if moe is None else active_numel(model.named_parameters(), *moe)


# Guard against a field rename drifting away from the override tables.
assert _HF_KEYS | _RESNET_KEYS | _MOE_KEYS <= {f.name for f in fields(ModelConfig)}
