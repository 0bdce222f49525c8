"""The single-process executor: runs a train-step Graph with torch kernels.

Invariants:
- Forward and backward ops run once per micro-batch, optimizer ops once per
  step; buffer and gradient-accumulator updates apply after every
  micro-batch, parameter and optimizer-state updates after the step.
- Every value is freed after its last use (see `codegen`), and `LiveBytes`
  measures the bytes held, state included, so the measured peak can be
  compared with a planned one.
- The executor owns its state: parameters are copied from the module's own
  `state_dict`, so a reference model trained beside it starts identical.
"""

from __future__ import annotations

import torch
from torch import nn

from meshplan.autodiff.optimizer import initial_state
from meshplan.errors import ConfigError
from meshplan.ir import Graph, Phase, Role
from meshplan.runtime.codegen import compile_segment
from meshplan.runtime.memory import LiveBytes

_PER_MICROBATCH = (Role.BUFFER, Role.GRAD)


class Executor:
    """Runs `graph` (a train step) on one device."""

    def __init__(self, graph: Graph, device: str | torch.device = "cpu"):
        self.graph = graph
        self.device = torch.device(device)
        self.mem = LiveBytes()
        roles = {v.name: v.role for v in graph.values if v.role is not Role.INTERNAL}
        self.data_ids = [v.id for v in graph.inputs_by_role(Role.DATA)]
        self.grad_names = [v.name for v in graph.inputs_by_role(Role.GRAD)]
        self.mb_updates = [(u.name, u.value) for u in graph.updates
                           if roles.get(u.name) in _PER_MICROBATCH]
        self.step_updates = [(u.name, u.value) for u in graph.updates
                             if roles.get(u.name) not in _PER_MICROBATCH]
        state_ids = {v.id: v.name for v in graph.values
                     if v.role not in (Role.INTERNAL, Role.DATA)}
        mb_ops = [op for op in graph.ops if op.phase is not Phase.OPTIMIZER]
        step_ops = graph.ops_in(Phase.OPTIMIZER)
        mb_reads = _reads(mb_ops)
        self.mb_state = [(vid, state_ids[vid]) for vid in mb_reads if vid in state_ids]
        self.run_microbatch = compile_segment(
            graph, mb_ops, reads=mb_reads, device=self.device, name="microbatch",
            keeps=[graph.loss] + [v for _, v in self.mb_updates],
        )
        # After the micro-batches, a per-micro-batch update value *is* the state.
        by_value = dict(state_ids) | {v: n for n, v in self.mb_updates}
        step_reads = _reads(step_ops)
        self.step_state = [(vid, by_value[vid]) for vid in step_reads]
        self.run_step = compile_segment(
            graph, step_ops, reads=step_reads, device=self.device, name="step",
            keeps=[v for _, v in self.step_updates],
        )

    def init_state(self, module: nn.Module) -> dict[str, torch.Tensor | None]:
        """Fresh state from the module: params and buffers copied, optimizer slots new."""
        own = dict(module.named_parameters()) | dict(module.named_buffers())
        state: dict[str, torch.Tensor | None] = {}
        for v in self.graph.values:
            if v.role in (Role.PARAM, Role.BUFFER):
                if v.name not in own:
                    raise ConfigError(f"module has no parameter or buffer '{v.name}'; "
                                      "capture and run the same model")
                state[v.name] = own[v.name].detach().to(self.device, copy=True)
            elif v.role is Role.OPT_STATE:
                fqn, slot = v.name.rsplit("@", 1)
                state[v.name] = initial_state(slot, state[fqn])
            elif v.role is Role.GRAD:
                state[v.name] = None
        for t in state.values():
            self.mem.add(t)
        return state

    def step(self, state: dict, microbatches: list[tuple[torch.Tensor, ...]]) -> float:
        """One training step over `microbatches`; returns the mean loss."""
        for name in self.grad_names:
            self._swap(state, name, None)
        losses = []
        for batch in microbatches:
            env = {vid: state[name] for vid, name in self.mb_state}
            for vid, t in zip(self.data_ids, batch):
                env[vid] = t
            self.run_microbatch(env, self.mem)
            losses.append(env.pop(self.graph.loss))
            for name, vid in self.mb_updates:
                self._swap(state, name, env[vid])
        env = {vid: state[name] for vid, name in self.step_state}
        self.run_step(env, self.mem)
        for name, vid in self.step_updates:
            self._swap(state, name, env[vid])
        return float(torch.stack([x.detach() for x in losses]).mean())

    def _swap(self, state: dict, name: str, new) -> None:
        """Replace state `name`; the segment already counted `new`."""
        old = state.get(name)
        state[name] = new
        self.mem.drop(old)


def _reads(ops) -> list[int]:
    """Values the ops read but do not define, in first-use order."""
    defined, out = set(), {}
    for op in ops:
        for r in op.refs():
            if r not in defined:
                out.setdefault(r, None)
        defined.update(op.outputs)
    return list(out)
