"""Tensor-parallel plans: module-path patterns -> styles -> parameter SBPs
and layout constraints at module boundaries.

The styles are the ones `parallelize_module` users know:

  colwise    weight S(0), bias S(0) on tp; the gradient of the module's input
             is made Replicate right where it is produced (one all-reduce)
  rowwise    weight S(1), bias R; the module's output is made Replicate
             right after it is produced (one all-reduce)
  vocab      an Embedding: weight S(0) (vocab rows), output made Replicate;
             a Linear head: weight S(0) (vocab columns of the logits), as colwise
  replicate  every parameter R

A tied parameter takes the style of every module that owns it under any of
its names; styles that split it differently are an error.

Sequence parallelism (Megatron's, `Strategy.sequence_parallel`): the
values between the tp modules are split along the sequence over tp, so the
norms, dropout and residual adds there run on 1/tp of the tokens. A
rowwise (and vocab embedding) output is hinted S(seq), not R, so its
reduction is a reduce-scatter, and its gradient R (an all-gather); a
colwise (and vocab head) input is hinted R (an all-gather right after its
producer) and its gradient S(seq) (a
reduce-scatter); the backward gathers that input again rather than keep
the gathered copy (`regather`), so a rank keeps 1/tp of every value between
the modules, as Megatron does. The sequence dim of a (batch, seq, hidden)
value is 1; a value of fewer dims stays R.

Invariant: constraints ("hints") are what make propagation produce exactly
Megatron's communication: propagation is greedy per op, and without them it
may prefer a cheaper reduce-scatter now for a dearer gather later.
"""

from __future__ import annotations

import re

from meshplan.errors import ConfigError
from meshplan.ir import Graph, Phase, Role
from meshplan.ir.choices import TpStyle
from meshplan.ir.sbp import Replicate, Sbp, Shard

R = Replicate()
_PARAM_SBP: dict[TpStyle, dict[str, Sbp]] = {
    TpStyle.COLWISE: {"weight": Shard(0), "bias": Shard(0)},
    TpStyle.ROWWISE: {"weight": Shard(1), "bias": R},
    TpStyle.VOCAB: {"weight": Shard(0), "bias": Shard(0)},
    TpStyle.REPLICATE: {},
}


def _style_of(module: str, plan) -> TpStyle | None:
    for pattern, style in plan:
        if re.fullmatch(pattern, module):
            return style
    return None


def tensor_parallel(graph: Graph, plan, tp_axis: int, sequence_parallel: bool = False):
    """(param SBP on the tp axis by value id, hints {value id: {axis: Sbp}},
    the values gathered again in each phase); with `sequence_parallel`,
    Megatron's sequence parallelism (below)."""
    params = {v.id: v for v in graph.inputs_by_role(Role.PARAM)}
    styles: dict[str, TpStyle] = {}
    param_sbp: dict[int, Sbp] = {}
    for v in params.values():
        for name in graph.names_of(v.name):  # a tied weight: every module that owns it
            module, _, leaf = name.rpartition(".")
            style = _style_of(module, plan)
            if style is None:
                continue
            styles[module] = style
            sbp = _PARAM_SBP[style].get(leaf, R)
            if param_sbp.setdefault(v.id, sbp) != sbp:
                raise ConfigError(
                    f"tied parameter '{v.name}' (also {', '.join(graph.names_of(v.name)[1:])}) "
                    f"gets {param_sbp[v.id]} from one module's style and {sbp} from "
                    f"'{module}' ({style}); give the modules sharing it styles that split it "
                    "alike (e.g. vocab for both the embedding and the head)")
    if plan and not styles:
        raise ConfigError(
            f"tensor-parallel plan matches no module (patterns: "
            f"{', '.join(p for p, _ in plan)}); module paths look like "
            f"{', '.join(sorted({v.name.rpartition('.')[0] for v in params.values()})[:3])}")
    hints: dict[int, dict[int, Sbp]] = {}
    regather: set[int] = set()
    inputs, outputs, kinds = _boundaries(graph, set(styles), set(params))
    grads = dict(graph.grads)
    def between(vid: int) -> Sbp:
        """A layout between tp blocks: R, or with sequence parallelism the
        sequence split (a (batch, seq, hidden) value's dim 1)."""
        shape = graph.values[vid].meta.shape
        return Shard(len(shape) - 2) if sequence_parallel and len(shape) >= 3 else R

    for module, style in styles.items():
        is_embedding = "aten.embedding.default" in kinds.get(module, ())
        if style == TpStyle.ROWWISE or (style == TpStyle.VOCAB and is_embedding):
            for vid in outputs.get(module, ()):
                hints.setdefault(vid, {})[tp_axis] = between(vid)
                if sequence_parallel and vid in grads:  # gathered whole for the backward
                    hints.setdefault(grads[vid], {})[tp_axis] = R
        elif style in (TpStyle.COLWISE, TpStyle.VOCAB):
            for vid in inputs.get(module, ()):
                if vid in grads:
                    hints.setdefault(grads[vid], {})[tp_axis] = between(vid)
                if sequence_parallel and between(vid) != R:  # gathered before the module
                    hints.setdefault(vid, {})[tp_axis] = R
                    regather.add(vid)
    return param_sbp, hints, frozenset(regather)


def _owner(path: str, modules: set[str]) -> str | None:
    """The planned module an op with module path `path` belongs to, if any."""
    while path:
        if path in modules:
            return path
        path = path.rpartition(".")[0]
    return None


def _boundaries(graph: Graph, modules: set[str], params: set[int]):
    """Per planned module: values entering it, values leaving it, op kinds in it."""
    owner_of_value: dict[int, str | None] = {}
    inputs: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    kinds: dict[str, set[str]] = {}
    for op in graph.ops:
        if op.phase is not Phase.FORWARD:
            continue
        owner = _owner(op.module_path, modules)
        for r in dict.fromkeys(op.refs()):
            src = owner_of_value.get(r)
            if owner is not None and src != owner and r not in params:
                inputs.setdefault(owner, []).append(r)
            if src is not None and src != owner and r not in outputs.get(src, ()):
                outputs.setdefault(src, []).append(r)
        for o in op.outputs:
            owner_of_value[o] = owner
        if owner is not None:
            kinds.setdefault(owner, set()).add(op.kind)
    return inputs, outputs, kinds
