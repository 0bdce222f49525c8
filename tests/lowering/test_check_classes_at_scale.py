"""The check over classes at 4096 ranks (issue 35): GPT-3 175B at tp8 pp16
vpp2 dp32, every rank's files; the directory passes, and a bug planted in one
rank's head, in one rank's body or in one class's body is caught, naming it."""

from __future__ import annotations

import shutil

import pytest

from meshplan.driver.compile import compile_job
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.mesh import Mesh
from meshplan.lowering.check_classes import check_dir
from meshplan.models import model_config
from tests.lowering.test_check_classes import body_and_task, errors, head, new_body, set_head

pytestmark = pytest.mark.slow
RANK = 2345  # a rank in the middle: stage 9, neither first nor last of anything


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    s = zoo_strategy("gpt", model_config("gpt", "gpt3-175b"), dp=32, tp=8, pp=16, vpp=2,
                     global_batch_size=64 * 32, micro_batch_size=1)
    job = plan_model("gpt", "gpt3-175b", Mesh(512, 8), s).job
    out = tmp_path_factory.mktemp("gpt3") / "plans"
    compile_job(job, out, workers=2, use_cache=False)
    return job, out


@pytest.fixture
def plan_dir(compiled, tmp_path):
    shutil.copytree(compiled[1], tmp_path / "p")
    return tmp_path / "p"


def test_4096_ranks_pass_over_16_classes(compiled):
    job, out = compiled
    assert job.mesh.world == 4096
    res = check_dir(out)[1]
    assert res.ok, res.errors[:3]
    assert len(res.ranks) == 4096 and len(list((out / "classes").iterdir())) == 16


def test_a_renaming_that_sends_two_ranks_to_one_id(plan_dir):
    set_head(plan_dir, RANK, head(plan_dir, RANK) | {"coord": head(plan_dir, RANK + 1)["coord"]})
    (e,) = errors(plan_dir)
    assert e.startswith(f"rank {RANK}: its head places it at stage") and "not rank" in e


def test_one_ranks_head_with_a_wrong_peer(plan_dir):
    """Its own body sends one piece to a fixed rank (coordinate (0, 1) of the
    peer stage), not to the peer at its own coordinate as its class does."""
    body, i = body_and_task(plan_dir, RANK, "send")
    stage, coord = body["tasks"][i][8]
    assert coord == [None, None]  # dp and tp free: the peer at the sender's coordinate
    body["tasks"][i][8] = [stage, [0, 1]]
    new_body(plan_dir, body, [RANK])
    (e,) = errors(plan_dir)
    assert "are of one class" in e and f" and {RANK} " in e and "different bodies" in e


def test_a_class_body_with_an_unmatched_send(plan_dir, compiled):
    job = compiled[0]
    stage = job.strategy.stage_of_rank(RANK)
    body, i = body_and_task(plan_dir, RANK, "recv")
    body["tasks"][i][0] = "compute"
    body["tasks"][i][8:11] = [None, None, None]
    members = [r for r in job.strategy.ranks_of_stage(stage)
               if head(plan_dir, r)["class"] == head(plan_dir, RANK)["class"]]
    new_body(plan_dir, body, members)
    errs = errors(plan_dir)
    assert any("send of op" in e and "has no matching recv there" in e for e in errs), errs[:3]
