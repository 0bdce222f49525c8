"""The op kinds meshplan itself emits; every other kind is an aten op
(`aten.<name>.<overload>`).

Names only: what each kind does (kernel, inference, category: compute,
collective, optimizer, transfer, local slice) is its rule in `ops/table.py`.

Invariant: each kind string is written here and nowhere else in meshplan
(tests/ops/test_table.py checks both).
"""

PREFIX = "meshplan."

# autodiff
GRAD_SUM = "meshplan.grad_sum"  # the sum of a value's gradient contributions
ACCUMULATE_GRAD = "meshplan.accumulate_grad"  # a micro-batch's gradient into the step's total
VJP = "meshplan.vjp"  # the generic gradient (ops/generic.py)
# random draws, layout-invariant (ops/random_ops.py)
DROPOUT = "meshplan.dropout"  # (out, mask) of x
RANDOM_LIKE = "meshplan.random_like"  # rand_like / randn_like / bernoulli
RANDOM = "meshplan.random"  # rand / randn / randint of a shape
# a mixture of experts' expert compute, routed (ops/routed_experts.py)
ROUTED_EXPERTS = "meshplan.routed_experts"
ROUTED_EXPERTS_BACKWARD = "meshplan.routed_experts_backward"
# optimizers
SGD = "meshplan.sgd"
ADAMW = "meshplan.adamw"
# global-norm clipping: a gradient's local sum of squares, their sum, the factor
GRAD_SQ = "meshplan.grad_sq"
SQ_SUM = "meshplan.sq_sum"
CLIP_COEF = "meshplan.clip_coef"
# boxing: collectives along a mesh axis, a rank keeping its part (of a whole tensor, or
# the whole as its share of a sum: the first rank of the axis, zeros elsewhere), a transfer
ALL_REDUCE = "meshplan.all_reduce"
REDUCE_SCATTER = "meshplan.reduce_scatter"
ALL_GATHER = "meshplan.all_gather"
ALL_TO_ALL = "meshplan.all_to_all"
LOCAL_SLICE = "meshplan.local_slice"
LOCAL_PARTIAL = "meshplan.local_partial"
TRANSFER = "meshplan.transfer"


def optimizer_kind(name: str) -> str:
    """The op kind of the optimizer named `name` in `OptimizerConfig` ("sgd")."""
    return {"sgd": SGD, "adamw": ADAMW}[name]


def short(kind: str) -> str:
    """"meshplan.all_reduce" -> "all_reduce" (an aten kind unchanged)."""
    return kind.removeprefix(PREFIX)
