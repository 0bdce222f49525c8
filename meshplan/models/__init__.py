"""Model zoo: GPT, BERT, ResNet and a mixture-of-experts GPT as plain
`nn.Module`s, plus presets.

Every model's forward takes `example_batch(cfg, ...)` and returns a scalar
loss; repeated layers are `blocks.{i}` (see `layer_pattern`).
"""

from meshplan.models.registry import (
    MODELS,
    PRESETS,
    ModelConfig,
    active_param_count,
    batch_spec,
    build_model,
    example_batch,
    layer_pattern,
    model_config,
    param_count,
    validate,
)

__all__ = [
    "MODELS",
    "PRESETS",
    "ModelConfig",
    "active_param_count",
    "batch_spec",
    "build_model",
    "example_batch",
    "layer_pattern",
    "model_config",
    "param_count",
    "validate",
]
