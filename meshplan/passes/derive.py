"""Work out `Strategy(tp_plan="derived", layer_pattern="derived")` from the
facts capture recorded about the module (`capture/structure.py`), and
`stage_layers="balanced"` from the op cost model (`passes/balance.py`).

Invariants:
- The result is an ordinary strategy (a regex layer pattern, a tuple tp
  plan) plus notes saying where each came from and every style mapped to
  a nearest one; the Job keeps both, so `plan` output shows what was chosen.
- transformers styles map to meshplan's: colwise, rowwise as themselves;
  `*_rep` / `*_gather_output` to the plain style (the output stays split and
  propagation gathers it only where needed; on the vocabulary head that is
  the `vocab` style, so the loss runs vocab-parallel); `embedding_rowwise`
  to `vocab`; anything else to `replicate`. Each mapping is one note.
- Checks, each one `ConfigError` line: a needed layer list that the module
  lacks; a tp degree that does not divide the vocabulary, or the attention
  heads a plan splits. Key/value heads (grouped-query attention) that tp
  does not divide are replicated instead, with a note.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.errors import ConfigError
from meshplan.ir import Graph
from meshplan.ir.choices import Recompute, TpStyle
from meshplan.ir.graph_facts import Structure
from meshplan.ir.mesh import BALANCED, DERIVED, Strategy
from meshplan.passes.balance import balance, graph_layer_weights

# transformers' tp-plan styles -> ours: the same name, or the nearest
_NEAR = {"colwise_rep": TpStyle.COLWISE, "colwise_gather_output": TpStyle.COLWISE,
         "rowwise_rep": TpStyle.ROWWISE, "embedding_rowwise": TpStyle.VOCAB,
         "local_colwise": TpStyle.COLWISE, "local_rowwise": TpStyle.ROWWISE}
_KV = ("k_proj", "v_proj", "key", "value", "wk", "wv", "k", "v")
_ATTN = ("q_proj", "query", "wq", "c_attn", "qkv", "Wqkv", "q")


def derives(strategy: Strategy) -> bool:
    """Whether `strategy` has a tp plan or a layer pattern to read off the module."""
    return strategy.tp_plan == DERIVED or strategy.layer_pattern == DERIVED


def resolve_derived(graph: Graph, strategy: Strategy) -> tuple[Strategy, tuple[str, ...]]:
    """`strategy` with its derived and balanced fields worked out; returns it and the notes."""
    strategy, notes = _resolve_structure(graph, strategy)
    if strategy.stage_layers == BALANCED:
        counts = balance(graph_layer_weights(graph, strategy.layer_pattern),
                         strategy.pp * strategy.vpp)
        strategy = replace(strategy, stage_layers=counts)
        notes += (f"stage_layers {BALANCED} = {list(counts)} layers per virtual stage (balanced by "
                  "the op cost model, embedding, head and loss counted)",)
    return strategy, notes


def _resolve_structure(graph: Graph, strategy: Strategy) -> tuple[Strategy, tuple[str, ...]]:
    if not derives(strategy):
        return strategy, ()
    facts = graph.facts.structure
    if facts is None:
        raise ConfigError(f"a {DERIVED} plan needs a graph captured by this meshplan (it records "
                          "the module's structure); capture the model again")
    notes: list[str] = []
    if strategy.layer_pattern == DERIVED:
        strategy = replace(strategy, layer_pattern=_layer_pattern(facts, strategy, notes))
    if strategy.tp_plan == DERIVED:
        strategy = replace(strategy, tp_plan=_tp_plan(facts, strategy.tp, notes))
    return strategy, tuple(notes)


def derived_layer_pattern(graph: Graph) -> str:
    """The layer regex derived from `graph`'s module ("" without a layer list)."""
    return resolve_derived(graph, Strategy(layer_pattern=DERIVED))[0].layer_pattern


def _layer_pattern(facts: Structure, s: Strategy, notes: list[str]) -> str:
    path = facts.layers
    if not path:
        if s.pp > 1 or s.vpp > 1 or (s.recompute != Recompute.NONE and not s.recompute_pattern):
            raise ConfigError(f"layer_pattern '{DERIVED}' found no layer list in {facts.model} "
                              "(no nn.ModuleList of blocks that the forward runs); pass "
                              "--layer-pattern with a regex naming one layer, e.g. "
                              "'blocks\\.\\d+'")
        return ""
    pattern = "|".join(p.replace(".", r"\.") + r"\.(\d+)" for p in path.split(","))
    notes.append(f"layer_pattern {DERIVED} = '{pattern}' ({facts.layers_from})")
    return pattern


def _tp_plan(facts: Structure, tp: int, notes: list[str]) -> tuple[tuple[str, TpStyle], ...]:
    if tp == 1:
        return ()
    entries = facts.tp
    vocab, heads, kv, model = facts.vocab, facts.heads, facts.kv_heads, facts.model
    if vocab and vocab % tp:
        raise ConfigError(f"tp={tp} does not divide the vocabulary ({vocab}) of {model}; "
                          f"choose tp among {_divisors(vocab)}")
    plan: list[tuple[str, TpStyle]] = []
    for pattern, style, given in entries:
        leaf = pattern.rsplit("\\.", 1)[-1]
        mine = _ours(style)
        if mine == TpStyle.COLWISE and given != "structure" and _is_head(pattern):
            mine = TpStyle.VOCAB
        if leaf in _ATTN and mine != TpStyle.REPLICATE and heads and heads % tp:
            raise ConfigError(f"tp={tp} does not divide the {heads} attention heads of {model}; "
                              f"choose tp among {_divisors(heads)}")
        if leaf in _KV and mine != TpStyle.REPLICATE and kv and kv % tp:
            notes.append(f"'{pattern}': {kv} key/value heads do not split over tp={tp}; "
                         "replicated (each rank computes all key/value heads)")
            mine = TpStyle.REPLICATE
        elif mine != style and given != "structure":
            notes.append(f"'{pattern}': transformers style '{style}' mapped to '{mine}'")
        plan.append((pattern, mine))
    notes.append(f"tp_plan {DERIVED} from {facts.tp_from}: " +
                 ", ".join(f"{p}={s}" for p, s in plan))
    return tuple(plan)


def _ours(style: str) -> TpStyle:
    """transformers' tp-plan `style` as ours (replicate where we have no near one)."""
    try:
        return TpStyle(style)
    except ValueError:
        return _NEAR.get(style, TpStyle.REPLICATE)


def _is_head(pattern: str) -> bool:
    """A vocabulary head by its module name (its column split is `vocab`)."""
    return pattern.rsplit("\\.", 1)[-1] in ("lm_head", "head", "decoder", "output")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)
