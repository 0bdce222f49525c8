"""Plan classes (`lowering/classes.py`): ranks of a stage at one coordinate
on the fixed axes share one body, lowered once (`lowering/stage_files.py`);
resolved at any rank, that body must equal lowering the rank alone."""

from __future__ import annotations

import json

import pytest

from meshplan.ir.sbp import R, Shard
from meshplan.lowering import classes
from meshplan.lowering.classes import encode, fixed_axes, resolve
from meshplan.lowering.files import open_head
from meshplan.lowering.stage_files import StageFiles
from tests.lowering.jobs import CONFIGS, job_of, plans_of

# name -> (fixed axes, classes): even splits leave every axis free (a class per stage)
CLASSES = {"gpt_tied_dp4": ((), 1), "resnet_dp4": ((), 1), "gpt_pp1": ((), 1),
           "gpt_2x4": ((), 2), "gpt_dp4": ((), 2), "bert_2x4": ((), 2),
           "gpt_uneven_dp2": ((1,), 4), "gpt_uneven_tp4": ((1,), 4), "gpt_uneven": ((1,), 8)}


def files_of(name: str, fixed=None):
    job = job_of(name)
    fixed = fixed_axes(job) if fixed is None else fixed
    stages: dict[int, StageFiles] = {}
    out, made = {}, 0
    for r in range(job.mesh.world):
        st = job.strategy.stage_of_rank(r)
        stages.setdefault(st, StageFiles(job.strategy, st, job.digest(),
                                         lambda st=st: job.view(st), fixed))
        head, klass, new = stages[st].files(r)
        out[r] = (open_head(head, "head"), klass)
        made += new
    return out, made


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_rank_resolved_from_its_class_equals_its_lowering(name):
    job, plans = job_of(name), plans_of(name)
    files, made = files_of(name)
    for r, (head, klass) in files.items():
        got = resolve(klass.body, r, tuple(head["coord"]), head["job_digest"], job.strategy,
                      job.mesh.devices_per_node)
        assert got == plans[r], f"rank {r}"
        assert head["class"] == klass.digest and head["stage"] == plans[r].stage
    assert made == len({k.digest for _, k in files.values()})
    if name in CLASSES:
        assert (fixed_axes(job), made) == CLASSES[name]


def test_a_class_blind_to_an_uneven_axis_is_caught():
    """Planted bug: with tp taken as free where vocab 130 splits 33/33/32/32,
    the tp ranks would share one body; the second member's lowering differs."""
    with pytest.raises(AssertionError, match="not symmetric at rank 3"):
        files_of("gpt_uneven_tp4", fixed=())


def test_which_transfers_and_splits_fix_axes():
    """A transfer is aligned when its two layouts agree and its replicated
    axes are last (else `fixed_axes` fixes every axis); a split fixes its
    axis when uneven, and every later axis cutting the same dim."""
    assert classes.aligned((Shard(0), R), (Shard(0), R))
    assert not classes.aligned((R, Shard(1)), (R, Shard(1)))  # a replica picked by flat index
    assert not classes.aligned((Shard(0), R), (Shard(0), Shard(1)))
    assert classes.uneven_axes((131, 8), (Shard(0), Shard(0)), (2, 4)) == {0, 1}
    assert classes.uneven_axes((130, 8), (Shard(0), Shard(0)), (2, 4)) == {1}
    assert classes.uneven_axes((128, 8), (Shard(0), Shard(1)), (2, 4)) == set()


def test_a_body_names_no_member():
    """Bodies of one class lowered at different members are equal bytes."""
    job, plans = job_of("gpt_dp4"), plans_of("gpt_dp4")
    fixed = fixed_axes(job)
    bodies = {json.dumps(encode(p, job.view(p.stage), job.strategy, fixed), sort_keys=True)
              for p in plans.values() if p.stage == 0}
    assert len(bodies) == 1
