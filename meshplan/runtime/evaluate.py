"""Evaluation on a rank: the forward-only plan, lowered once, run over the
validation split with the training state's own tensors.

Invariants:
- The eval Job (`passes/plan.plan_forward`) has the train Job's mesh,
  strategy and stages; each parameter or buffer it reads has the same box on
  this rank as in the train Job (checked at load), so the evaluator reads
  the training state in place: no copy, no re-slicing.
- It has no backward and no optimizer: its B actions and STEP do nothing,
  and it never writes the state.
- Batch `b` of an evaluation is the validation split's samples
  `[b * G, (b + 1) * G)` in order (no shuffle), G the global batch size: every
  evaluation reads the same samples, at any layout.
- The loss is the mean over the batches of each batch's loss (the mean of
  its micro-batches'), on the ranks that hold it; None elsewhere.
"""

from __future__ import annotations

import torch

from meshplan.data.feed import FeedReader, TokenFeed
from meshplan.errors import PlanError
from meshplan.ir import Role
from meshplan.ir.job import Job
from meshplan.runtime.own_plan import rank_plan
from meshplan.runtime.rank_executor import RankExecutor


class Evaluator:
    """One rank's evaluation: `run(state)` is the validation loss."""

    def __init__(self, eval_job: Job, train, comm, device, feed_json: str, batches: int,
                 on_action=None):
        """`train`: the train executor's `RankContext` (its Job and this rank)."""
        self.ex = RankExecutor(eval_job, rank_plan(eval_job, train.rank, torch.device(device).type),
                               comm, device=device)
        self.ex.on_action = on_action
        _same_boxes(eval_job, train.job, self.ex.ctx, train)
        s = eval_job.strategy
        self.reader = FeedReader(TokenFeed.from_json(feed_json), s.global_batch_size,
                                 s.num_microbatches)
        self.batches = batches
        held = {b.value for b in self.ex.plan.buffers}
        g = eval_job.graph
        self.names = [g.values[i].name for i in g.inputs if i in held
                      and g.values[i].role in (Role.PARAM, Role.BUFFER)]

    def run(self, state: dict) -> float | None:
        """The validation loss of the weights in `state` (this rank's slices)."""
        view = {n: state[n] for n in self.names}
        losses = []
        with torch.no_grad():
            for b in range(self.batches):
                rows = self.ex.rows
                mbs = self.reader.microbatches(b, rows) if rows is not None \
                    else [() for _ in range(self.ex.job.strategy.num_microbatches)]
                out = self.ex.step(view, mbs, local_rows=True)
                if out:
                    losses.append(float(torch.stack(out).mean()))
        return sum(losses) / len(losses) if losses else None


def _same_boxes(eval_job: Job, train_job: Job, mine, theirs) -> None:
    """Every state tensor the eval plan reads has the train plan's box here."""
    boxes = {v.name: theirs.box(v.id) for v in train_job.graph.values
             if v.role in (Role.PARAM, Role.BUFFER)}
    for v in eval_job.graph.values:
        if v.role in (Role.PARAM, Role.BUFFER) and boxes.get(v.name) != mine.box(v.id):
            raise PlanError(f"the evaluation plan lays out '{v.name}' as {mine.box(v.id)} on "
                            f"rank {mine.rank}, the training plan as {boxes.get(v.name)}; "
                            "evaluate with the training strategy (this is meshplan's fault: "
                            "report it)")
