"""Graph facts: what capture, the precision pass and autodiff record about a
graph beside its ops (`Graph.facts`), as one typed, frozen record.

Invariants:
- Facts, not decisions: the model's class, the other names of tied tensors,
  the module structure derived plans read, the precision the model's own
  casts were captured for and the one the precision pass cast for, the
  train step's optimizer, micro-batch count and loss scale, and the
  modules that register its custom ops (`torch.library`), which a process
  reading the graph imports, as unpickling imports a class's module.
- A pass adds its facts with `dataclasses.replace`; no field is a string
  standing for a number or for JSON.
- Files hold them as the string pairs of `ir/serialize.py: facts_to_pairs`,
  the one place that writes and reads that form (Job bytes unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.ir.choices import NonFinite, OptimizerKind, Precision
from meshplan.ir.lr_schedule import LrSchedule
from meshplan.ir.optimizer_config import OptimizerConfig


@dataclass(frozen=True, slots=True)
class Structure:
    """What capture records about a module's structure, for derived plans
    (`capture/structure.py` finds them, `passes/derive.py` reads them)."""

    layers: str  # the layer lists' module paths, joined by commas ("" none)
    layers_from: str  # where the layer list came from (a note for the user)
    tp: tuple[tuple[str, str, str], ...]  # (module regex, tp style, where declared)
    tp_from: str
    heads: int  # 0: unknown
    kv_heads: int
    vocab: int
    model: str  # the class name of the (transformers) model


@dataclass(frozen=True, slots=True)
class TrainFacts:
    """What autodiff records about the train step it built."""

    optimizer: OptimizerKind
    num_microbatches: int
    optimizer_config: OptimizerConfig  # what autodiff built the step from
    on_nonfinite: NonFinite | None = None  # None: no gradient norm is computed
    lr_schedule: tuple[LrSchedule, float] | None = None  # resolved, and the base rate
    loss_scale: float | None = None  # fp16's initial loss scale


@dataclass(frozen=True, slots=True)
class GraphFacts:
    model_class: str | None = None
    # (other name, graph input name) of each tied parameter or buffer, sorted
    aliases: tuple[tuple[str, str], ...] = ()
    structure: Structure | None = None
    precision: Precision = Precision.FP32  # what apply_precision cast for
    train: TrainFacts | None = None  # None: a forward graph
    # the Python modules whose import registers the graph's custom ops, sorted
    op_modules: tuple[str, ...] = ()
    # the precision whose dtypes the model's own casts resolved under (capture,
    # `capture/model_casts.py`); the precision pass takes only its own
    captured_for: Precision = Precision.FP32
