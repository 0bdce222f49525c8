"""One layer's work, planned for real: a probe.

The search never plans a 96-layer Job per candidate. For each (tp,
micro-batch size, recompute) it plans the same model cut to three layers
(`ModelSpec.probe_plan`) as three pipeline stages, one layer each, lowers
one rank per stage, and reads their `Work` (`work.read_work`):

    stage 0 = embedding + layer      stage 1 = one layer      stage 2 = layer + head + loss

so one layer is stage 1, and the first and last stages' extras are stage 0
and stage 2 minus it. The probe runs two micro-batches, all F, then all I,
then all W (a GPipe order with the backward split), so every value a
micro-batch keeps between actions has a slot per micro-batch and the
split's I and W are priced apart (B = I + W).

A captured graph (`GraphSpec`, for `Strategy(auto=True)`) cannot be
rebuilt: its probe plans the whole graph as three stages, the first layer,
the L - 2 in between and the last, so one layer is the middle stage over
L - 2 (`Work.per`); and its batch, one micro-batch over dp, is fixed, so
the probe runs at the dp that gives a rank the micro-batch size asked
(its dp collectives do not count: `estimate.with_dp` puts the
candidate's in their place).

Invariants:
- A probe is a plain planner run (capture, passes, lower): its costs are
  those of the Job a candidate would get, with dp = 1 (the dp collectives
  are added by `estimate`).
- Probes are cached per (spec, tp, micro-batch, recompute); their Work per
  device model. A planner error (tp not dividing the heads, ...) is cached
  too and makes every candidate of that key invalid, with its one line.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Any, TypeAlias

from meshplan.costmodel import DeviceModel
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.errors import ConfigError, ScheduleError
from meshplan.ir.mesh import Mesh
from meshplan.ir.zero import ZeroLevel
from meshplan.lowering.lower import lower
from meshplan.models import model_config
from meshplan.passes.plan import PASSES, Compilation
from meshplan.passes.strategy import check_strategy
from meshplan.schedules.registry import CSV
from meshplan.search.work import Work, read_work

if TYPE_CHECKING:
    from meshplan.autodiff import OptimizerConfig
    from meshplan.ir.graph import Graph
    from meshplan.ir.job import Job
    from meshplan.ir.mesh import Strategy

PROBE_LAYERS = 3


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A zoo or transformers model as `plan_model` takes it, and the training
    step. Its probes rebuild it with three layers, at any micro-batch size."""

    model: str
    size: str
    overrides: tuple[tuple[str, Any], ...] = ()
    optimizer: str | OptimizerConfig = "adamw"  # clipping's collectives count too
    precision: str = "fp32"

    def config(self, **more):
        return model_config(self.model, self.size, **dict(self.overrides), **more)

    @property
    def layers(self) -> int:
        return self.config().layers

    @property
    def name(self) -> str:
        cfg = self.config()
        return f"{self.model} {self.size} ({cfg.layers} layers, {cfg.heads} heads)"

    @property
    def samples(self) -> int:
        """dp x micro-batch size, when fixed (never: the model is rebuilt)."""
        return 0

    @property
    def experts(self) -> int:
        """Experts per block of a mixture of experts (0: none)."""
        return getattr(self.config(), "experts", 0) or 0

    def strategy(self, layers: int = 0, **fields) -> Strategy:
        cfg = self.config(layers=layers) if layers else self.config()
        return zoo_strategy(self.model, cfg, precision=self.precision, **fields)

    def plan(self, mesh: Mesh, strategy: Strategy, layers: int = 0) -> Job:
        more = {"layers": layers} if layers else {}
        return plan_model(self.model, self.size, mesh, strategy, optimizer=self.optimizer,
                          encode=False, **{**dict(self.overrides), **more}).job

    @property
    def seq(self) -> int:
        """The sequence's length (0: none, as a ResNet's)."""
        return getattr(self.config(), "seq_len", 0) or 0

    def probe_plan(self, tp: int, mbs: int, recompute: str, dp: int, zero: ZeroLevel,
                   ep: int = 1, cp: int = 1, sp: bool = False):
        """The probe's Job (three layers as three stages, `_orders`) and
        Strategy, and the layers of its middle stage."""
        n = PROBE_LAYERS
        strategy = self.strategy(n, dp=dp, tp=tp, pp=n, vpp=1, zero=zero, ep=ep, cp=cp,
                                 sequence_parallel=sp,
                                 global_batch_size=2 * mbs * dp, micro_batch_size=mbs,
                                 schedule=CSV, schedule_orders=_orders(), recompute=recompute,
                                 bucket_mb=0)
        return self.plan(Mesh(n, tp * dp * cp), strategy, n), strategy, 1


@dataclass(frozen=True, slots=True, eq=False)
class GraphSpec:
    """A captured graph (`api.capture`) as the search takes it, for
    `Strategy(auto=True)`. Its batch is one micro-batch over dp, so a
    candidate's dp x micro-batch size must make it (`samples`); the probes
    plan the whole graph as three stages: the first layer, the rest but
    one, the last (`probe_plan`)."""

    graph: Graph
    base: Strategy       # the user's own fields: layer pattern, tp plan, precision, ...
    optimizer: OptimizerConfig
    layers: int
    samples: int
    name: str

    @property
    def precision(self) -> str:
        return str(self.base.precision)

    def strategy(self, layers: int = 0, **fields) -> Strategy:
        return replace(self.base, auto=False, **fields)

    def plan(self, mesh: Mesh, strategy: Strategy, layers: int = 0) -> Job:
        strategy = check_strategy(mesh, strategy)
        return PASSES.run(Compilation(self.graph, mesh, strategy, self.optimizer)).job

    experts = seq = 0  # not searched for a captured graph: its ep and cp are 1

    def probe_plan(self, tp: int, mbs: int, recompute: str, dp: int, zero: ZeroLevel,
                   ep: int = 1, cp: int = 1, sp: bool = False):
        assert ep == cp == 1 and not sp, "a captured graph's probes: ep and cp 1, no sp"
        n, b = PROBE_LAYERS, self.samples
        d = dp if dp > 1 else b // mbs  # a rank's micro-batch is the probe's
        mid = self.layers - 2
        strategy = self.strategy(dp=d, tp=tp, pp=n, vpp=1, zero=zero, global_batch_size=2 * b,
                                 micro_batch_size=b // d, schedule=CSV,
                                 schedule_orders=_orders(), recompute=recompute, bucket_mb=0,
                                 stage_layers=(1, mid, 1), layer_stages=())
        return self.plan(Mesh(n, tp * d), strategy), strategy, mid


Spec: TypeAlias = "ModelSpec | GraphSpec"


def _orders() -> tuple[tuple[str, ...], ...]:
    """F for two micro-batches, then I, then W, on each of the probe's stages."""
    return tuple(tuple(f"{r}{kind}{mb}" for kind in "FIW" for mb in range(2))
                 for r in range(PROBE_LAYERS))


@dataclass(frozen=True, slots=True)
class Probe:
    first: Work    # what the first stage does beyond one layer (the embedding)
    body: Work     # one layer
    last: Work     # what the last stage does beyond one layer (head and loss)

    def stage(self, layers: int, first: bool, last: bool) -> Work:
        """A stage of `layers` layers, with the extras it holds."""
        w = self.body.times(layers)
        if last:
            w = w.plus(self.last)
        if first:  # nothing on the first stage is an input gradient: all of it is W
            w = w.plus(self.first)
            w = replace(w, i=0.0, w=w.i + w.w, saved_i=0, saved_w=w.saved_i + w.saved_w,
                        saved_iw=0)
        return w


def probe(spec: Spec, tp: int, mbs: int, recompute: str, dev: DeviceModel,
          dp: int = 1, zero: ZeroLevel = ZeroLevel.NONE, ep: int = 1, cp: int = 1,
          sp: bool = False) -> Probe:
    """One layer's Work at (tp, micro-batch `mbs`, `recompute`) on `dev`;
    raises the planner's ConfigError for a tp the model cannot use. With
    `dp` = 2 and a ZeRO level, its dp collectives are the level's pattern
    (which ZeRO 3 cannot derive: it gathers again in the backward only what
    the backward reads). With `dp` = `ep` > 1, the experts rest split over
    ep and its all-to-alls are the candidate's; with `cp` > 1, a rank holds
    1/cp of the sequence and its keys' and values' gathers are planned; with
    `sp`, the activations between tp blocks are split by sequence over tp
    (`probe_key`)."""
    job, reps, span = _planned(spec, tp, mbs, recompute, dp, zero, ep, cp, sp)
    works = [read_work(job, reps[s], dev).by_stage[s] for s in range(PROBE_LAYERS)]
    body = replace(works[1].per(span), layers=1)
    return Probe(works[0].minus(body), body, works[2].minus(body))


def probe_key(tp: int, mbs: int, recompute: str, ep: int = 1, cp: int = 1,
              sp: bool = False) -> tuple:
    """The probe of a candidate's layers: at dp = 1, or with ep > 1 at
    dp = ep (its experts split, its tokens sent by all-to-all), at its cp,
    with sequence parallelism or not."""
    if ep == cp == 1 and not sp:
        return (tp, mbs, recompute)
    return (tp, mbs, recompute, ep, ZeroLevel.NONE, ep, cp, sp)


@cache
def _planned(spec: Spec, tp: int, mbs: int, recompute: str, dp: int = 1,
             zero: ZeroLevel = ZeroLevel.NONE, ep: int = 1, cp: int = 1, sp: bool = False):
    try:
        job, strategy, span = spec.probe_plan(tp, mbs, recompute, dp, zero, ep, cp, sp)
    except (ConfigError, ScheduleError) as err:
        raise ConfigError(str(err)) from None
    return job, {s: lower(job, strategy.ranks_of_stage(s)[0])
                 for s in range(PROBE_LAYERS)}, span


def forget_probes() -> None:
    """Drop the planned probes (kept per spec, for every device model)."""
    _planned.cache_clear()


def probe_pool() -> ProcessPoolExecutor | None:
    """Forked worker processes, one per core, that `probe_many` may reuse
    (they keep what they captured and planned); None on one core."""
    if (os.cpu_count() or 1) < 2:
        return None
    ctx = multiprocessing.get_context("fork")  # the workers share this process's imports
    return ProcessPoolExecutor(os.cpu_count(), mp_context=ctx)


def probe_many(spec: Spec, keys: list[tuple], dev: DeviceModel,
               pool: ProcessPoolExecutor | None = None) -> dict:
    """`probe(spec, *key)` for every key (tp, mbs, recompute[, dp, zero, ep, cp]), in
    `pool`'s workers, or in a pool of its own: {key: Probe, or the planner's
    ConfigError}. One core, or few keys: here, in turn."""
    if (os.cpu_count() or 1) < 2 or len(keys) < 4:
        return {k: probe_or_error(spec, k, dev) for k in keys}
    own = pool is None
    pool = pool or probe_pool()
    assert pool is not None
    try:
        return dict(zip(keys, pool.map(probe_or_error, [spec] * len(keys), keys,
                                       [dev] * len(keys))))
    finally:
        if own:
            pool.shutdown()


def probe_or_error(spec: Spec, key: tuple, dev: DeviceModel):
    """`probe` of a key (tp, mbs, recompute[, dp, zero, ep, cp]), or its ConfigError."""
    try:
        tp, mbs, recompute, *rest = key
        return probe(spec, tp, mbs, recompute, dev, *rest)
    except ConfigError as err:
        return err
