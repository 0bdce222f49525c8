"""`meshplan check` over plan classes (`lowering/check_classes.py`): the
heads rank by rank, the proofs on each class's representative. Each planted
bug below is in one rank's head or one class's body, and is caught."""

from __future__ import annotations

import pytest

from meshplan.driver.compile import compile_job
from meshplan.ir.fileio import encode_part, seal_parts
from meshplan.ir.kinds import GRAD_SQ
from meshplan.lowering.check import check_plans
from meshplan.lowering.check_classes import check_dir
from meshplan.lowering.files import (
    KIND,
    VERSION,
    class_bytes,
    class_name,
    open_class,
    open_head,
    plan_name,
)
from meshplan.lowering.lower import lower
from tests.lowering.jobs import job_of, plans_of

NAME = "gpt_dp4"  # dp4 tp2 pp2: 16 ranks, 2 classes


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("plans")
    compile_job(job_of(NAME), out, workers=1, use_cache=False)
    return out


@pytest.fixture
def plan_dir(compiled, tmp_path):
    import shutil
    shutil.copytree(compiled, tmp_path / "p")
    return tmp_path / "p"


def head(d, rank: int) -> dict:
    return open_head((d / plan_name(rank)).read_bytes(), "x")


def set_head(d, rank: int, h: dict) -> None:
    (d / plan_name(rank)).write_bytes(seal_parts(KIND, VERSION, {"head": encode_part(h)}))


def new_body(d, body: dict, ranks) -> str:
    """Write `body` as a class and point `ranks`' heads at it."""
    digest, data = class_bytes(body)
    (d / class_name(digest)).write_bytes(data)
    for r in ranks:
        set_head(d, r, head(d, r) | {"class": digest})
    return digest


def body_and_task(d, rank: int, kind: str) -> tuple[dict, int]:
    """`rank`'s class body and the index of its first task of `kind`."""
    body = open_class((d / class_name(head(d, rank)["class"])).read_bytes(), "x")
    return body, next(i for i, t in enumerate(body["tasks"]) if t[0] == kind)


def errors(d) -> list[str]:
    res = check_dir(d)[1]
    assert not res.ok
    return res.errors


def test_classes_prove_what_every_rank_proves(compiled):
    job, res = check_dir(compiled)
    full = check_plans(job, plans_of(NAME))
    assert res.ok and full.ok
    assert (res.bubble_ratio, res.predicted_step_s) == (full.bubble_ratio, full.predicted_step_s)
    assert res.ranks == full.ranks and len(res.ranks) == 16
    assert len(list((compiled / "classes").iterdir())) == 2


def test_a_renaming_that_sends_two_ranks_to_one_id(plan_dir):
    h = head(plan_dir, 5)
    set_head(plan_dir, 5, h | {"coord": head(plan_dir, 6)["coord"]})
    (e,) = errors(plan_dir)
    assert e.startswith("rank 5: its head places it at stage 0") and "not rank 5's place" in e
    set_head(plan_dir, 5, h | {"coord": [0]})  # too short a coordinate: the same line
    (e,) = errors(plan_dir)
    assert e.startswith("rank 5: its head places it at stage 0, coordinate [0]")


def test_a_head_naming_another_stages_class(plan_dir):
    set_head(plan_dir, 3, head(plan_dir, 3) | {"class": head(plan_dir, 12)["class"]})
    (e,) = errors(plan_dir)
    assert e.startswith("rank 3: its head names class") and "not the class of stage 0" in e


def test_one_ranks_head_with_a_wrong_peer(plan_dir):
    """Rank 6's own body sends one piece to another rank than its class's."""
    body, i = body_and_task(plan_dir, 6, "send")
    body["tasks"][i][8] = [1, [0, 1]]  # stage 1, coordinate (0, 1): a fixed peer
    new_body(plan_dir, body, [6])
    (e,) = errors(plan_dir)
    assert e.startswith("ranks 0 and 6 are of one class") and "different bodies" in e


def test_a_class_body_with_an_unmatched_send(plan_dir):
    """Stage 1's class drops a receive: every rank of stage 0 sends into nothing."""
    body, i = body_and_task(plan_dir, 8, "recv")
    body["tasks"][i][0] = "compute"
    body["tasks"][i][8:11] = [None, None, None]
    new_body(plan_dir, body, range(8, 16))
    errs = errors(plan_dir)
    assert any("rank 0: send of op" in e and "has no matching recv there" in e for e in errs)


def test_a_head_of_another_job_or_rank_is_one_line(plan_dir):
    from meshplan.errors import PlanError
    set_head(plan_dir, 2, head(plan_dir, 2) | {"rank": 3})
    with pytest.raises(PlanError, match="holds the plan of rank 3"):
        check_dir(plan_dir)


def test_the_norm_proof_over_classes(tmp_path):
    """With clipping, `check` reads every rank's norm tasks (its class's, its
    own groups): a whole directory passes as rank by rank does, and a class
    body whose tp ranks all count a replicated norm weight fails."""
    from tests.lowering.test_check_norm import job_of as clip_job

    job = clip_job("dp2·tp2·pp2·vpp2")
    compile_job(job, tmp_path / "p", workers=1, use_cache=False)
    res = check_dir(tmp_path / "p")[1]
    full = check_plans(job, {r: lower(job, r) for r in range(job.mesh.world)})
    assert res.ok and full.ok and res.predicted_step_s == full.predicted_step_s
    d = tmp_path / "p"
    body, _ = body_and_task(d, 0, "compute")
    first = [i for i, t in enumerate(body["tasks"])
             if job.graph.ops[t[1]].kind == GRAD_SQ and "replica_first" in t[6]]
    assert first
    for i in first:
        body["tasks"][i][6] = ["" for _ in body["tasks"][i][6]]
    new_body(d, body, [r for r in range(job.mesh.world) if head(d, r)["stage"] == 0])
    assert any("counts" in e and "more than once" in e for e in errors(d))
