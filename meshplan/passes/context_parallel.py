"""Context parallelism's one check: every attention computes on a split of
the sequence's ranks, not replicated over them.

Invariants:
- Nothing here chooses a layout. The inputs rest split by sequence over the
  cp axis (`propagate._input_layouts`), and propagation carries the split
  through every position-wise op; attention's rule (`ops/sbp_nn.py`)
  offers its queries split by sequence against whole keys and values (the
  boxing all-gathers them: Llama 3's form), or a head or batch split
  (DeepSpeed Ulysses' all-to-alls), and the cheaper is chosen.
- A model whose attention cannot compute on a split over cp (no
  `scaled_dot_product_attention` at all, or one replicated over cp: a
  causal one with grouped-query heads, which SDPA runs only whole) gains
  nothing from cp: one ConfigError line naming the op and its module.
"""

from __future__ import annotations

from meshplan.errors import ConfigError
from meshplan.ir import Graph, Phase
from meshplan.ir.sbp import Shard

ATTENTION = ("aten._scaled_dot_product_flash_attention_for_cpu.default",
             "aten.scaled_dot_product_attention.default")


def check_attention_split(graph: Graph, sigs: dict, cp_axis: int, cp: int) -> None:
    """One ConfigError line unless the graph has attention and each one's
    queries are split over the cp axis (`sigs`: op id -> a signature per axis)."""
    ops = [op for op in graph.ops if op.kind in ATTENTION and op.phase is Phase.FORWARD]
    if not ops:
        raise ConfigError(f"--cp {cp}: the model has no scaled_dot_product_attention to split "
                          "by sequence (context parallelism splits attention's queries; an "
                          "attention with dropout runs as its math ops: set its dropout to 0); "
                          "use --cp 1")
    for op in ops:
        if not isinstance(sigs[op.id][cp_axis].ins[0], Shard):
            where = op.module_path or "the model"
            raise ConfigError(f"--cp {cp}: the attention {op.kind} in {where} cannot compute on "
                              "a split of the sequence (a causal one with grouped-query heads "
                              "runs only whole); use --cp 1")
