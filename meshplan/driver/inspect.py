"""inspect: capture a zoo model on the meta device and count what it holds."""

from __future__ import annotations

import re
import time

from meshplan.driver.plan import capture_built
from meshplan.ir import Role
from meshplan.models import active_param_count, build_model, layer_pattern, model_config
from meshplan.ops.table import rule_for
from meshplan.passes.derive import derived_layer_pattern


def inspect_model(model: str, size: str, batch_size: int = 1, **overrides) -> dict:
    """Op, parameter and layer counts of a model, captured without weights."""
    cfg = model_config(model, size, **overrides)
    t0 = time.perf_counter()
    module = build_model(cfg, device="meta")
    t1 = time.perf_counter()
    graph = capture_built(cfg, batch_size, module)
    t2 = time.perf_counter()
    params = graph.inputs_by_role(Role.PARAM)
    pattern = re.compile(layer_pattern(cfg) or derived_layer_pattern(graph))
    layers = {m.group(0) for op in graph.ops if (m := pattern.match(op.module_path))}
    generic = sorted({op.kind for op in graph.ops if not rule_for(op.kind).exact})
    return {
        "model": model, "size": size, "ops": len(graph.ops), "params": len(params),
        "param_numel": sum(p.meta.numel for p in params),
        "active_numel": active_param_count(cfg, module),  # per token; None: dense
        "param_bytes": graph.param_bytes(), "layers": len(layers),
        "buffers": len(graph.inputs_by_role(Role.BUFFER)),
        "generic_ops": generic, "build_s": t1 - t0, "capture_s": t2 - t1,
    }
