"""Eager PyTorch reference training, the judge of every meshplan run.

Invariant: the reference sees exactly the data meshplan sees: the same
global batches, split into the same micro-batches, with each micro-batch's
loss scaled by 1/num_microbatches before `backward()` so gradients
accumulate to the gradient of the mean loss. Mixed precision uses torch's
own `torch.autocast` (and, for fp16, `torch.amp.GradScaler` with the same
initial scale and growth interval as meshplan). Clipping is torch's own
`clip_grad_norm_`, after GradScaler's `unscale_`, as torch's recipe has it;
the optimizer holds two parameter groups (with and without weight decay),
and a learning-rate schedule is torch's scheduler classes, stepped after
every step (a skipped fp16 step included).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import NamedTuple

import torch
from torch import nn

from meshplan.autodiff.optimizer import OptimizerConfig, torch_optimizer, torch_scheduler
from meshplan.driver.kinks import KinksFlipped
from meshplan.ir import LOSS_SCALE
from meshplan.ir.choices import Precision
from meshplan.ir.graph import LOW_DTYPES
from meshplan.ir.state_name import StateName
from meshplan.runtime.amp import GROWTH_INTERVAL, INIT_SCALE
from meshplan.runtime.data import split_microbatches


class EagerRun(NamedTuple):
    """What the reference run ends with: its losses and step times, and its
    final state by meshplan's state names (`eager_state`)."""

    losses: list[float]
    step_s: list[float]
    state: dict[str, torch.Tensor]
    grad_norms: list[float] = []  # clip_grad_norm_'s total norm per step (clipping on)


def eager_state(module: nn.Module, opt: torch.optim.Optimizer | None = None,
                scaler=None) -> dict[str, torch.Tensor]:
    """`module`'s parameters and buffers by FQN, its optimizer's slots as
    `<fqn>@<slot>` and GradScaler's scale as `amp@loss_scale`: the names of
    meshplan's state, so a run's final state can be compared tensor by tensor."""
    out, seen = {}, set()
    for k, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # a tied tensor once, under its first name (as capture)
            seen.add(id(t))
            out[k] = t.detach().cpu().clone()
    name_of = {id(p): k for k, p in module.named_parameters()}
    for p, slots in (opt.state.items() if opt is not None else ()):
        for slot, t in slots.items():
            if torch.is_tensor(t):
                out[str(StateName(name_of[id(p)], slot))] = t.detach().cpu().clone()
    if scaler is not None:
        out[LOSS_SCALE] = scaler.get_scale() * torch.ones((), dtype=torch.float32)
    return out


def eager_train(
    module: nn.Module, batches, num_microbatches: int, optimizer: OptimizerConfig,
    precision: Precision = Precision.FP32, init_scale: float = INIT_SCALE, device: str = "cpu",
    after_step=None, masks=None, flip_kinks: bool = False,
) -> EagerRun:
    """Train `module` in place on `batches`; returns losses, step seconds and
    the final state (on the CPU). On `device` cuda the module moves there,
    each micro-batch is copied there, and a step's time ends at a device
    synchronize. `after_step(k)` is called after the k-th step (k from 1),
    e.g. to evaluate. With `masks` (a `same_masks.SameMasks`) each
    micro-batch's random calls draw meshplan's numbers; else torch's own.
    With `flip_kinks` each ReLU's backward takes the other side where fp32
    cannot tell its side (`kinks.KinksFlipped`: the judge's rounding noise)."""
    dev = torch.device(device)
    low = LOW_DTYPES[precision].torch if precision in LOW_DTYPES else None
    module.to(dev)
    opt = torch_optimizer(optimizer, module)
    with warnings.catch_warnings():  # SequentialLR's own call of step(0) is deprecated
        warnings.simplefilter("ignore", UserWarning)
        sched = torch_scheduler(optimizer, opt)
    scaler = torch.amp.GradScaler(dev.type, init_scale=init_scale,
                                  growth_interval=GROWTH_INTERVAL) \
        if precision == Precision.FP16 else None
    losses, times, norms = [], [], []
    for step, batch in enumerate(batches):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k, mb in enumerate(split_microbatches(batch, num_microbatches)):
            mb = tuple(t.to(dev) for t in mb)
            with torch.autocast(dev.type, dtype=low, enabled=low is not None), \
                    masks.at(step, k) if masks is not None else contextlib.nullcontext(), \
                    KinksFlipped() if flip_kinks else contextlib.nullcontext():
                loss = module(*mb)
            scaled = loss / num_microbatches if num_microbatches > 1 else loss
            (scaler.scale(scaled) if scaler else scaled).backward()
            total += loss.detach().float()
        if scaler:
            scaler.unscale_(opt)
        if optimizer.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), optimizer.max_grad_norm)
            norms.append(float(norm))
        elif optimizer.guard is not None:  # the guard's norm, no clipping
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            norms.append(float(torch.nn.utils.get_total_norm(grads)))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                sched.step()
        losses.append(float(total / num_microbatches))  # a sync on a GPU
        times.append(time.perf_counter() - t0)
        if after_step is not None:
            after_step(len(losses))
    return EagerRun(losses, times, eager_state(module, opt, scaler), norms)


def eager_eval(module: nn.Module, batches, num_microbatches: int) -> float:
    """The evaluation loss of `module` on `batches`: each batch's loss the
    mean of its micro-batches', the mean over the batches (as the ranks'
    forward-only plan computes it), in eval mode and without gradients."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            per_batch = [float(torch.stack([module(*mb) for mb in
                                            split_microbatches(b, num_microbatches)]).mean())
                         for b in batches]
    finally:
        module.train(was_training)
    return sum(per_batch) / len(per_batch)
