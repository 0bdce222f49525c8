"""The gradient norm's proof over classes (`lowering/check_norm_classes.py`)
gives the verdict of the rank-by-rank proof (`check_norm.norm_coverage` on
every rank's resolved plan): on correct plans, on planted bugs, and on
random mutations of one class's norm tasks."""

from __future__ import annotations

import copy
import re
import shutil
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.driver.compile import compile_job
from meshplan.driver.plan import plan_model
from meshplan.ir.kinds import ALL_REDUCE, GRAD_SQ
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.lowering.check_classes import check_dir
from meshplan.lowering.check_norm import norm_coverage
from meshplan.lowering.files import class_name, open_class, read_dir
from tests.lowering.test_check_classes import head, new_body
from tests.lowering.test_check_norm import CLIP, LAYERS

LAYOUTS = {
    "dp2·tp2·pp2·vpp2": (dict(dp=2, tp=2, pp=2, vpp=2, global_batch_size=8,
                              schedule="interleaved", layer_pattern=LAYERS), {}),
    "tied dp2·tp2·pp2": (dict(dp=2, tp=2, pp=2, global_batch_size=8, micro_batch_size=2,
                              layer_pattern=LAYERS), {"tie_embeddings": True}),
    "zero0 dp4·tp2": (dict(dp=4, tp=2, global_batch_size=8), {}),  # dp not summed
    "zero3 dp4": (dict(dp=4, zero=3, global_batch_size=8), {}),
    # vocab 130 over tp 4: tp is a fixed axis, its lines join classes
    "uneven zero1 dp2·tp4·pp2": (dict(dp=2, tp=4, pp=2, zero=1, global_batch_size=8,
                                      micro_batch_size=2, layer_pattern=LAYERS),
                                 {"vocab": 130}),
}


@cache
def _compiled(name: str, root: str):
    fields, over = LAYOUTS[name]
    s = Strategy(**fields)
    job = plan_model("gpt", "tiny", Mesh(1, s.dp * s.tp * s.pp), s, CLIP, **over).job
    out = f"{root}/{re.sub(r'[^a-z0-9]', '_', name)}"
    compile_job(job, out, workers=1, use_cache=False)
    return job, out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("norm"))


def _named(errors: list[str]) -> set[str]:
    """The parameters the norm's errors name, or the kind of error."""
    out = set()
    for e in errors:
        if "norm" in e:
            got = re.findall(r"'([^']+)'", e)
            out |= set(got) if got else {e.split(": ", 1)[-1]}
    return out


def _verdicts(job, d) -> tuple[set[str], set[str]]:
    """(over classes, rank by rank): what each proof's norm errors name."""
    res = check_dir(d)[1]
    _, plans = read_dir(d)
    return (_named([e for e in res.errors if any(
                        k in e for k in ("gradient norm", "its norm", "clipping factor",
                                         "norms are reduced"))]),
            _named(norm_coverage(job, plans)))


@pytest.mark.parametrize("name", LAYOUTS)
def test_correct_plans_pass_both_ways(name, root):
    job, out = _compiled(name, root)
    classes, ranks = _verdicts(job, out)
    assert classes == ranks == set()


def _body(d, klass: str) -> dict:
    return copy.deepcopy(open_class((d / class_name(klass)).read_bytes(), "x"))


def _norm_tasks(job, body) -> tuple[list[int], list[int]]:
    """A body's grad_sq tasks and its step's all-reduces (the norm's among them)."""
    g = job.graph
    sq = [i for i, t in enumerate(body["tasks"]) if g.ops[t[1]].kind == GRAD_SQ]
    reduce = [i for i, t in enumerate(body["tasks"]) if g.ops[t[1]].kind == ALL_REDUCE
              and t[3] == "optimizer"]
    return sq, reduce


def _mutate(job, d, pick: st.DataObject) -> str:
    """One class body's norm mutated: a grad_sq's variant tag toggled on one
    axis, or an all-reduce's group renamed (another axis, across no stage,
    none). Returns what was done."""
    grid = job.strategy.grid
    world = job.mesh.world
    heads = [head(d, r) for r in range(world)]
    klass = pick.draw(st.sampled_from(sorted({h["class"] for h in heads})))
    body = _body(d, klass)
    sq, reduce = _norm_tasks(job, body)
    if reduce and pick.draw(st.booleans()):
        i = pick.draw(st.sampled_from(reduce))
        refs = [["axis", a] for a in range(len(grid))] + [["none"]]
        ref = pick.draw(st.sampled_from(refs))
        body["groups"].append(ref)
        body["tasks"][i][7] = len(body["groups"]) - 1
        what = f"task {i}: group {ref}"
    else:
        i = pick.draw(st.sampled_from(sq))
        a = pick.draw(st.integers(0, len(grid) - 1))
        tags = body["tasks"][i][6]
        tags[a] = "" if tags[a] == "replica_first" else "replica_first"
        what = f"task {i}: tags {tags}"
    new_body(d, body, [r for r in range(world) if heads[r]["class"] == klass])
    return what


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(LAYOUTS)), pick=st.data())
def test_a_mutated_class_gets_the_rank_by_rank_verdict(name, pick, root, tmp_path_factory):
    job, out = _compiled(name, root)
    d = tmp_path_factory.mktemp("m") / "p"
    shutil.copytree(out, d)
    what = _mutate(job, d, pick)
    classes, ranks = _verdicts(job, d)
    assert classes == ranks, what


def test_the_proof_over_classes_reads_no_member(root, monkeypatch):
    """At a whole directory the norm is argued over classes: the rank-by-rank
    proof is not run, and the verdict stands."""
    from meshplan.lowering import check as check_mod

    job, out = _compiled("uneven zero1 dp2·tp4·pp2", root)
    monkeypatch.setattr(check_mod, "norm_coverage", lambda *a: pytest.fail("read every rank"))
    assert check_dir(out)[1].ok


def _without_reductions(job, d) -> None:
    """Planted (one stage: one class): the step's all-reduces name no group."""
    body = _body(d, head(d, 0)["class"])
    _, reduce = _norm_tasks(job, body)
    assert reduce
    body["groups"].append(["none"])
    for i in reduce:
        body["tasks"][i][7] = len(body["groups"]) - 1
    new_body(d, body, range(job.mesh.world))


def test_a_class_without_its_norm_reductions(root, tmp_path):
    """Planted: a class's norm all-reduces name no group: its members' norms
    are their own pieces' only. Both proofs say so."""
    job, out = _compiled("zero3 dp4", root)
    shutil.copytree(out, tmp_path / "p")
    d = tmp_path / "p"
    _without_reductions(job, d)
    classes, ranks = _verdicts(job, d)
    assert classes and classes == ranks


def test_a_chain_not_of_lines_falls_back_to_every_ranks_norm(root, tmp_path, monkeypatch):
    """Where the classes' argument does not apply (a listed group: None), the
    check reads every rank's norm tasks: it passes a correct directory and
    still catches the planted bug above."""
    from meshplan.lowering import check_classes

    monkeypatch.setattr(check_classes, "norm_over_classes", lambda *a: None)
    job, out = _compiled("zero3 dp4", root)
    assert check_dir(out)[1].ok
    shutil.copytree(out, tmp_path / "p")
    d = tmp_path / "p"
    _without_reductions(job, d)
    res = check_dir(d)[1]
    assert not res.ok and any("gradient norm" in e or "norms are" in e for e in res.errors)
