"""Zero-bubble schedules (zb1p, zbv): refusal until the runtime splits the
backward, validity on the grid, bubble and memory figures, docstring pictures.

Bubble figures with unit F, I and W costs and free comm (so B = 2), all
measured exactly: zb1p (pp-1)/(3*vpp*m), a third of interleaved 1F1B's
(vpp = 1: the paper's ZB-H1 (pp-1)/(3m)); zbv (pp-1)/(6m) once
m >= 3*pp // 2, above it below. Memory, as micro-batches of a chunk begun
(F run) and not finished (W not yet run): zb1p peaks at pp*vpp on every rank
and zbv at 2*pp chunks of half a stage, both 1F1B's peak of pp stages.
"""

import re

import pytest

from meshplan.errors import ScheduleError
from meshplan.schedules import compute_actions, placement_of, validate
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.grid import ascii_timeline
from meshplan.schedules.zb1p import split_backward

from ._util import ZB_GRID, compute, grid_id, lowered, parse_lists, run

UNIT = dict(cost_i=lambda stage: 1.0, cost_w=lambda stage: 1.0)


@pytest.mark.parametrize("case", ZB_GRID, ids=grid_id)
def test_grid_validates_and_simulates(case):
    name, pp, vpp, m = case
    validate(lowered(*case), pp, vpp, m, placement=placement_of(name, pp, vpp))
    res = run(*case, **UNIT)
    assert res.ok, res.deadlock
    assert all(b == pytest.approx(3 * vpp * m) for b in res.busy.values())


@pytest.mark.parametrize("case", [c for c in ZB_GRID if c[0] == "zb1p"], ids=grid_id)
def test_zb1p_bubble_is_a_third_of_interleaved(case):
    name, pp, vpp, m = case
    res = run(*case, **UNIT)
    assert abs(res.bubble_ratio - (pp - 1) / (3 * vpp * m)) < 1e-9
    assert abs(res.step_time - (3 * vpp * m + pp - 1)) < 1e-9
    base = "interleaved" if vpp > 1 else "1f1b"
    one_f_one_b = run(base, pp, vpp, m, cost_b=lambda stage: 2.0)
    assert abs(res.bubble_ratio - one_f_one_b.bubble_ratio / 3) < 1e-9


@pytest.mark.parametrize("pp", range(1, 9))
def test_zbv_bubble(pp):
    for m in range(1, 4 * pp + 3):
        ratio = run("zbv", pp, 2, m, **UNIT).bubble_ratio
        if m >= 3 * pp // 2:
            assert abs(ratio - (pp - 1) / (6 * m)) < 1e-9, m
        else:
            assert ratio > (pp - 1) / (6 * m) + 1e-9, m


def begun_not_done(order: list[Action], last: ActionType) -> int:
    """Peak count of (stage, micro-batch) with F run and `last` not yet run."""
    live = peak = 0
    for a in order:
        live += (a.type is ActionType.F) - (a.type is last)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("case", [c for c in ZB_GRID if c[1] > 1], ids=grid_id)
def test_memory_is_1f1b_peak(case):
    name, pp, vpp, m = case
    peaks = [begun_not_done(acts, ActionType.W) for acts in compute(*case).values()]
    base = [begun_not_done(acts, ActionType.B) for acts in compute("1f1b", pp, 1, m).values()]
    assert max(peaks) == vpp * max(base) == vpp * pp
    if name == "zb1p":
        assert peaks == [pp * vpp] * pp


def test_split_backward_lags_w():
    order = parse_lists({0: "0F0 0F1 0B0 0F2 0B1 0B2"})[0]
    text = " ".join(map(str, split_backward(order, lag=1)))
    assert text == "0F0 0F1 0I0 0F2 0I1 0W0 0I2 0W1 0W2"
    assert " ".join(map(str, split_backward(order, lag=0))) == \
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2"
    assert split_backward(order, lag=5)[-3:] == parse_lists({0: "0W0 0W1 0W2"})[0]


def test_zb1p_counts():
    with pytest.raises(ScheduleError, match=r"multiple of 2.*num_microbatches=5 pp=2.*"
                                            r"--num-microbatches 4 or 6"):
        compute_actions("zb1p", 2, 2, 5, 0)
    # fewer micro-batches than ranks run as one round, as in torch
    acts = compute("zb1p", 4, 2, 2)
    validate(lowered("zb1p", 4, 2, 2), 4, 2, 2)
    assert all(len(a) == 3 * 2 * 2 for a in acts.values())


def test_zbv_needs_vpp2_and_drops_padding():
    with pytest.raises(ScheduleError, match="zbv places two virtual stages per stage in a V, got "
                                            "vpp=3; use --vpp 2"):
        compute_actions("zbv", 2, 3, 4, 0)
    acts = compute("zbv", 4, 2, 2)  # fewer than 2*pp - 1 micro-batches
    assert all(a.microbatch < 2 for r in acts.values() for a in r)
    assert run("zbv", 4, 2, 2, **UNIT).ok


def _diagram_blocks(module: str) -> list[list[str]]:
    """The docstring's timeline, as blocks of `time`/`rank` lines."""
    from importlib import import_module
    blocks: list[list[str]] = [[]]
    for line in import_module(f"meshplan.schedules.{module}").__doc__.splitlines():
        if re.match(r"    (time|stage) ", line):
            blocks[-1].append(line[4:])
        elif blocks[-1]:
            blocks.append([])
    return [b for b in blocks if b]


@pytest.mark.parametrize("name,pp,vpp,m", [("zb1p", 2, 2, 4), ("zbv", 2, 2, 4)])
def test_docstring_diagrams_are_simulated(name, pp, vpp, m):
    lines = ascii_timeline(run(name, pp, vpp, m, **UNIT).timeline).splitlines()
    blocks = _diagram_blocks(name)
    cut = len(blocks[0][0])
    assert blocks == [[line[:cut] for line in lines], [line[:7] + line[cut:] for line in lines]]
