"""The single-process executor: the one-rank case of `RankExecutor`.

`Executor(graph)` plans the train step for one rank (one stage, no boxing)
with `plan_job` (the pass list, from a train step), lowers rank 0 and runs
it with the same executor every rank of a cluster uses: there is one
executor, not two.
"""

from __future__ import annotations

import torch

from meshplan.ir import Graph
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.passes.plan import plan_job
from meshplan.runtime.own_plan import rank_plan
from meshplan.runtime.rank_executor import RankExecutor


class Executor:
    """Runs `graph` (a train step) on one device."""

    def __init__(self, graph: Graph, device: str | torch.device = "cpu",
                 kernels: str = "eager"):
        m = graph.facts.train.num_microbatches if graph.facts.train else 1
        strategy = Strategy(global_batch_size=m, precision=graph.facts.precision)
        self.job = plan_job(graph, Mesh(1, 1), strategy)
        self.graph = self.job.graph
        device = torch.device(device)
        self.rank = RankExecutor(self.job, rank_plan(self.job, 0, device.type), device=device,
                                 kernels=kernels)
        self.mem = self.rank.mem

    def init_state(self, module) -> dict:
        """Fresh state from the module: params and buffers copied, optimizer slots new."""
        return self.rank.init_state(module)

    def step(self, state: dict, microbatches) -> float:
        """One training step over `microbatches`; returns the mean loss."""
        losses = self.rank.step(state, microbatches)
        return float(torch.stack([x.detach() for x in losses]).mean())
