"""The IR: frozen dataclasses for graphs, values and ops."""

from meshplan.ir.builder import GraphBuilder
from meshplan.ir.graph import (
    ABSENT,
    DEVICE,
    GRAD_NORM,
    LOSS_SCALE,
    LR,
    STEP_COUNT,
    Arg,
    DType,
    Graph,
    Lit,
    Op,
    Phase,
    Ref,
    Role,
    TensorMeta,
    Update,
    Value,
)
from meshplan.ir.serialize import graph_from_bytes, graph_to_bytes, load_graph, save_graph
from meshplan.ir.well_formed import check_well_formed

__all__ = [
    "ABSENT", "DEVICE", "GRAD_NORM", "LOSS_SCALE", "LR", "STEP_COUNT", "Arg", "DType",
    "Graph", "GraphBuilder", "Lit", "Op", "Phase", "Ref", "Role", "TensorMeta", "Update",
    "Value", "check_well_formed", "graph_from_bytes", "graph_to_bytes", "load_graph",
    "save_graph",
]
