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
from meshplan.ir.job import Job, StageView, stage_view
from meshplan.runtime.own_plan import rank_plan
from meshplan.runtime.rank_executor import RankExecutor


class Evaluator:
    """One rank's evaluation: `run(state)` is the validation loss."""

    def __init__(self, eval_job: Job | StageView, train, comm, device, feed_json: str,
                 batches: int, on_action=None):
        """`eval_job`: the eval Job, or its view of this rank's stage; `train`:
        the train executor's `RankContext` (its view and this rank)."""
        view = stage_view(eval_job, train.stage)
        self.ex = RankExecutor(view, rank_plan(view, train.rank, torch.device(device).type),
                               comm, device=device)
        self.ex.on_action = on_action
        _same_boxes(view, train.view, self.ex.ctx, train)
        s = view.strategy
        self.reader = FeedReader(TokenFeed.from_json(feed_json), s.global_batch_size,
                                 s.num_microbatches)
        self.batches = batches
        held = {b.value for b in self.ex.plan.buffers}
        self.names = [view.values[i].name for i in view.inputs if i in held
                      and view.values[i].role in (Role.PARAM, Role.BUFFER)]

    def run(self, state: dict) -> float | None:
        """The validation loss of the weights in `state` (this rank's slices)."""
        view = {n: state[n] for n in self.names}
        losses = []
        with torch.no_grad():
            for b in range(self.batches):
                rows = self.ex.rows
                mbs = self.reader.microbatches(b, rows) if rows is not None \
                    else [() for _ in range(self.ex.view.strategy.num_microbatches)]
                out = self.ex.step(view, mbs, local_rows=True)
                if out:
                    losses.append(float(torch.stack(out).mean()))
        return sum(losses) / len(losses) if losses else None


def _same_boxes(eval_view: StageView, train_view: StageView, mine, theirs) -> None:
    """Every state tensor the eval plan reads has the train plan's box here."""
    boxes = {v.name: theirs.box(v.id) for v in train_view.values.values()
             if v.role in (Role.PARAM, Role.BUFFER)}
    for v in eval_view.values.values():
        if v.role in (Role.PARAM, Role.BUFFER) and boxes.get(v.name) != mine.box(v.id):
            raise PlanError(f"the evaluation plan lays out '{v.name}' as {mine.box(v.id)} on "
                            f"rank {mine.rank}, the training plan as {boxes.get(v.name)}; "
                            "evaluate with the training strategy (this is meshplan's fault: "
                            "report it)")
