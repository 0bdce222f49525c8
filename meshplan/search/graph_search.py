"""`Strategy(auto=True)` in the Python API: the search over a captured graph.

Invariants:
- `searched_strategy` prices one layer of the user's own graph (found by
  its layer pattern, `auto` deriving it) and returns the search's proven
  winner as the graph's Strategy: dp, tp, pp, vpp, schedule, micro-batch,
  recompute, ZeRO level and layers per virtual stage searched, the user's
  other fields (precision, buckets, tp plan) kept.
- The graph's probes are forgotten afterwards: they fit no other search.
- A graph the search cannot price (under 3 layers, inputs of several batch
  sizes) is one ConfigError line.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.costmodel import load_device_model
from meshplan.errors import ConfigError
from meshplan.ir import Role
from meshplan.ir.mesh import DERIVED
from meshplan.passes.derive import derived_layer_pattern
from meshplan.passes.pipeline import find_layers
from meshplan.search.probe import GraphSpec, forget_probes
from meshplan.search.search import search


def searched_strategy(graph, mesh, strategy, opt, device_model: str,
                      memory_per_device: int | None):
    """`Strategy(auto=True)`: the search's proven winner on a captured graph."""
    pattern = strategy.layer_pattern
    if pattern in ("", DERIVED):
        pattern = derived_layer_pattern(graph)
    layers = len(find_layers(graph, pattern)[0]) if pattern else 0
    if layers < 3:
        raise ConfigError(f"Strategy(auto=True) prices one layer from a graph of at least 3 "
                          f"layers, and finds {layers} (layer pattern '{pattern}'); give "
                          "Strategy(layer_pattern=...) that matches each layer, or choose "
                          "the strategy by hand")
    sizes = {v.meta.shape[0] for v in graph.inputs_by_role(Role.DATA) if v.meta.shape}
    if len(sizes) != 1:
        raise ConfigError(f"Strategy(auto=True) needs one batch size across the graph's "
                          f"inputs; they have {sorted(sizes)}")
    model = graph.facts.structure.model if graph.facts.structure else "model"
    base = replace(strategy, layer_pattern=pattern,
                   tp_plan=strategy.tp_plan or DERIVED, stage_layers=(), layer_stages=())
    spec = GraphSpec(graph, base, opt, layers, sizes.pop(),
                     f"the captured {model} ({layers} layers)")
    try:
        res = search(spec, mesh, strategy.global_batch_size, load_device_model(device_model),
                      memory_limit=memory_per_device, bucket_mb=strategy.bucket_mb)
    finally:
        forget_probes()  # this graph's probes are of no use to another search
    c = res.winner.cand
    return spec.strategy(dp=c.dp, tp=c.tp, pp=c.pp, vpp=c.vpp, schedule=c.schedule,
                         micro_batch_size=c.micro_batch_size, recompute=c.recompute,
                         zero=c.zero,
                         stage_layers=res.winner.pred.stage_layers if c.pp > 1 else ())
