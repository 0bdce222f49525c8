"""Jobs and plans shared by the plan tests, built once per test session."""

from __future__ import annotations

from functools import cache

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.job import Job
from meshplan.ir.mesh import Mesh
from meshplan.lowering.lower import lower
from meshplan.lowering.rankplan import RankPlan
from meshplan.models import model_config

# name -> (model, nodes, devices_per_node, config overrides, strategy fields)
CONFIGS: dict[str, tuple] = {
    "gpt_2x4": ("gpt", 2, 4, {}, dict(dp=2, tp=2, pp=2, vpp=2, global_batch_size=16,
                                      micro_batch_size=2)),
    "gpt_1f1b": ("gpt", 2, 4, {}, dict(dp=2, tp=2, pp=2, global_batch_size=16,
                                       micro_batch_size=2)),
    # vocab 130 over tp=4: wte/head rows split 33, 33, 32, 32
    "gpt_uneven": ("gpt", 2, 4, {"vocab": 130}, dict(dp=1, tp=4, pp=2, global_batch_size=8,
                                                     micro_batch_size=2)),
    "gpt_pp1": ("gpt", 1, 4, {}, dict(dp=2, tp=2, global_batch_size=8, micro_batch_size=2)),
    "gpt_gpipe": ("gpt", 1, 4, {}, dict(pp=4, global_batch_size=8, micro_batch_size=2,
                                        schedule="gpipe")),
    "gpt_interleaved": ("gpt", 1, 2, {}, dict(pp=2, vpp=2, global_batch_size=4,
                                              micro_batch_size=2, schedule="interleaved")),
    "bert_2x4": ("bert", 2, 4, {}, dict(dp=2, tp=2, pp=2, global_batch_size=8,
                                        micro_batch_size=2)),
    "resnet_1x4": ("resnet", 1, 4, {}, dict(dp=2, pp=2, global_batch_size=8,
                                            micro_batch_size=2)),
}
# one stage, so no sends: ranks share plan bodies where their groups and shapes agree
CONFIGS.update({
    "gpt_tied_dp4": ("gpt", 1, 4, {"tie_embeddings": True}, dict(dp=4, global_batch_size=8,
                                                           micro_batch_size=2)),
    "gpt_uneven_dp2": ("gpt", 1, 8, {"vocab": 130}, dict(dp=2, tp=4, global_batch_size=8,
                                                         micro_batch_size=2)),
    "gpt_uneven_tp4": ("gpt", 1, 4, {"vocab": 130}, dict(tp=4, global_batch_size=4,
                                                         micro_batch_size=2)),
    "resnet_dp4": ("resnet", 2, 2, {}, dict(dp=4, global_batch_size=8, micro_batch_size=2)),
})
for _dp in (1, 2, 4):  # same per-rank work, dp scaled: 4 micro-batches of 2 per replica
    CONFIGS[f"gpt_dp{_dp}"] = ("gpt", 1, 4 * _dp, {}, dict(dp=_dp, tp=2, pp=2,
                                                          global_batch_size=8 * _dp,
                                                          micro_batch_size=2))


@cache
def job_of(name: str) -> Job:
    model, nodes, dpn, over, fields = CONFIGS[name]
    cfg = model_config(model, "tiny", **over)
    strategy = zoo_strategy(model, cfg, **fields)
    return plan_model(model, "tiny", Mesh(nodes, dpn), strategy, **over).job


@cache
def plans_of(name: str) -> dict[int, RankPlan]:
    job = job_of(name)
    return {r: lower(job, r) for r in range(job.mesh.world)}
