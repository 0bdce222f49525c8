"""What capture records about a module's structure, for derived plans.

Invariants:
- Facts, not decisions: the layer list, the tensor-parallel entries the
  model itself declares (transformers' `_tp_plan`, or its config's
  `base_model_tp_plan`) or that its structure shows (the vocabulary
  embedding and head, and Megatron's pairs by module name), and
  the head, key/value-head and vocabulary counts.
  `passes/derive.py` turns them into a plan once the tp degree is known.
- They live in the graph's facts (`GraphFacts.structure`), so a captured
  graph carries them into planning, caches and files.
- The layer list is transformers' `_pp_plan` ModuleList if declared, else
  the longest `nn.ModuleList` of the lists the forward runs (ModernVBERT's
  vision encoder is the longest, and a text batch never enters it), of one
  block class where two are as long; its blocks may be of several classes
  (Mllama's self- and cross-attention layers, Inkling 2's full and sliding
  ones, Zamba 2's Mamba and hybrid ones, whose one-class lists are adapters
  inside a layer); an
  encoder-decoder has two, the encoder's then the decoder's (`layers` holds
  their paths joined by commas, in the order the forward runs them).
- Module paths are relative to the captured module, as op module paths are.
"""

from __future__ import annotations

import re

from torch import nn

from meshplan.ir.graph_facts import Structure


def structure_facts(module: nn.Module, ran: frozenset[str] | None = None) -> Structure:
    """The structure facts of `module`; `ran`, the module paths of the
    captured forward's ops (None: every module runs)."""
    hf_path, hf = _transformers_model(module)
    conf = getattr(hf, "config", None)
    runs = (lambda path: True) if ran is None else \
        (lambda path: any(p.startswith(path + ".") for p in ran))
    layers, layers_from = _layer_list(module, hf_path, hf, runs)
    vocab = _int(conf, "vocab_size") or _largest_embedding(module)
    tp, tp_from = _declared_tp(hf_path, hf)
    if not tp:
        named = _named_pairs(module, layers)
        tp = named + [[re.escape(p), "vocab", "structure"]
                      for p in _vocab_modules(module, vocab, layers)]
        tp_from = ("structure: Megatron's pairs by module name (q/k/v and fc1 colwise, "
                   "their out and fc2 rowwise, ...) and the vocabulary embedding and head"
                   if named else
                   "structure: the vocabulary embedding and head only")
    return Structure(
        layers=layers, layers_from=layers_from, tp=tuple((p, s, g) for p, s, g in tp),
        tp_from=tp_from, heads=_int(conf, "num_attention_heads", "n_head"),
        kv_heads=_int(conf, "num_key_value_heads") or _int(conf, "num_attention_heads", "n_head"),
        vocab=vocab, model=type(hf if hf is not None else module).__name__)


def _int(conf, *names: str) -> int:
    for n in names:
        v = getattr(conf, n, None)
        if isinstance(v, int):
            return v
    return 0


def _transformers_model(module: nn.Module):
    """(path, module) of the first transformers PreTrainedModel inside."""
    for path, m in module.named_modules():
        if hasattr(m, "config") and hasattr(m, "base_model_prefix"):
            return path, m
    return "", None


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _layer_list(module: nn.Module, hf_path: str, hf, runs) -> tuple[str, str]:
    named = dict(module.named_modules())
    for key in (getattr(hf, "_pp_plan", None) or {}):  # a key may name no module (hrm_text)
        path = _join(hf_path, key)
        if isinstance(named.get(path), nn.ModuleList) and runs(path):
            return path, "transformers _pp_plan"
    stacks = _stacks(module, hf)
    lists = [p for p, _ in (_longest_list(module, s, runs) for s in stacks) if p]
    if len(lists) == len(stacks) > 1:
        return ",".join(lists), ("structure: the longest nn.ModuleList of blocks in the "
                                 "encoder, then in the decoder")
    best, one_class = _longest_list(module, "", runs)
    kinds = "one block class" if one_class else "blocks of several classes"
    return best, f"structure: the longest nn.ModuleList of {kinds}" if best else ""


def _stacks(module: nn.Module, hf) -> list[str]:
    """The encoder's and the decoder's paths, in that order, of an
    encoder-decoder model ([""] otherwise: the whole module)."""
    if not getattr(getattr(hf, "config", None), "is_encoder_decoder", False):
        return [""]
    parts = [getattr(hf, f"get_{k}", lambda: None)() for k in ("encoder", "decoder")]
    paths = {id(m): p for p, m in module.named_modules()}
    found = [paths.get(id(m)) for m in parts]
    return [p for p in found if p] if all(found) else [""]


def _longest_list(module: nn.Module, under: str, runs) -> tuple[str, bool]:
    """The longest nn.ModuleList under the module path `under` that the
    forward runs (of one block class where two are as long), and whether
    its blocks are of one class."""
    best, key = "", (0, False)
    root = module.get_submodule(under) if under else module
    for path, m in root.named_modules():
        if not isinstance(m, nn.ModuleList):
            continue
        k = (len(m), len({type(c) for c in m.children()}) == 1)
        if k > key and runs(_join(under, path)):
            best, key = _join(under, path), k
    return best, key[1]


def _declared_tp(hf_path: str, hf) -> tuple[list, str]:
    if hf is None:
        return [], ""
    plan = getattr(hf, "_tp_plan", None)
    where = "transformers _tp_plan"
    if not plan:
        base = getattr(hf.config, "base_model_tp_plan", None) or {}
        prefix = getattr(hf, "base_model_prefix", "")
        plan = {_join(prefix if hasattr(hf, prefix) else "", k): v for k, v in base.items()}
        where = "config.base_model_tp_plan"
    if not plan:
        return [], ""
    out = []
    for key, style in plan.items():
        parts = (re.escape(p) if p != "*" else r"\d+" for p in _join(hf_path, key).split("."))
        out.append([r"\.".join(parts), style, style])
    return out, where


# The layers Megatron splits, by their names in transformers' models: a
# column-split group and the row-split layer that reads it, in one parent
# (attention's q/k/v and its output; the MLP's up and down projections). A
# two-part name places its parent one level up: BERT's attention.self.query
# and attention.output.dense are both attention's, its intermediate.dense
# and output.dense the block's. Absent: a fused q/k/v (GPT-2's c_attn,
# ModernBERT's Wqkv, Falcon's query_key_value), whose output is q|k|v, which
# a column split would not cut by heads; and attentions whose scores meet a
# whole tensor of all heads (DeBERTa's disentangled query_proj.., CPM-Ant's
# project_q.. beside its position bias), which a head split gathers back at
# every layer.
_COLWISE = frozenset({
    "q_proj", "k_proj", "v_proj", "q", "k", "v", "fc1", "wi", "wi_0", "wi_1", "up_proj",
    "gate_proj", "fc_in", "c_fc", "self.query", "self.key", "self.value",
    "intermediate.dense", "query", "key", "value", "ffn", "q_lin", "k_lin", "v_lin", "lin1",
    "Wq", "Wk", "Wv", "q_head", "k_head", "v_head", "linear_1", "w_in.w_0", "w_in.w_1",
    "layer_1", "dense_h_to_4h"})
_ROWWISE = frozenset({
    "out_proj", "o_proj", "o", "fc2", "wo", "down_proj", "fc_out", "c_proj", "output.dense",
    "dense", "ffn_output", "out_lin", "lin2", "post_proj", "linear_2", "w_out", "layer_2",
    "dense_4h_to_h"})
_NAMES = _COLWISE | _ROWWISE


def _named(sub: str) -> tuple[str, str] | None:
    """(parent, style) of the layer at `sub` by its name: its last two
    names when they are one of ours, else its last."""
    parts = sub.split(".")
    for k in (2, 1):
        name = ".".join(parts[-k:])
        if len(parts) >= k and name in _NAMES:
            return ".".join(parts[:-k]), "colwise" if name in _COLWISE else "rowwise"
    return None


def _named_pairs(module: nn.Module, layers: str) -> list[list[str]]:
    """tp entries for the Linear layers of the first block of each layer list
    whose names pair a column split with a row split under one parent (BART's
    self_attn.q_proj/k_proj/v_proj with out_proj, fc1 with fc2; T5's q/k/v
    with o, wi with wo; BERT's above); any block index."""
    out = []
    for path in filter(None, layers.split(",")):
        blocks = module.get_submodule(path)
        if not len(blocks):
            continue
        kids: dict[str, dict[str, str]] = {}  # parent path -> sub path -> style
        for sub, m in blocks[0].named_modules():
            found = _named(sub) if isinstance(m, nn.Linear) else None
            if found:
                kids.setdefault(found[0], {})[sub] = found[1]
        for leaves in kids.values():
            if {"colwise", "rowwise"} <= set(leaves.values()):
                out += [[rf"{re.escape(path)}\.\d+\.{re.escape(sub)}$", style, "structure"]
                        for sub, style in leaves.items()]
    return out


def _largest_embedding(module: nn.Module) -> int:
    sizes = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    return max(sizes, default=0)


def _vocab_modules(module: nn.Module, vocab: int, layers: str) -> list[str]:
    """The embedding and the head over the vocabulary: outside the layers."""
    if not vocab:
        return []
    inside = tuple(p + "." for p in layers.split(",") if p)
    return [p for p, m in module.named_modules()
            if not p.startswith(inside)
            and ((isinstance(m, nn.Embedding) and m.num_embeddings == vocab)
                 or (isinstance(m, nn.Linear) and m.out_features == vocab))]
