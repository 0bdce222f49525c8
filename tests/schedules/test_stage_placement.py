"""Stage placements: interleaved (default) and V, and what the lowering does with them."""

import pytest

from meshplan.errors import ScheduleError
from meshplan.ir.stage_placement import StagePlacement
from meshplan.schedules import add_comm, placement_of, validate
from meshplan.schedules.action import ActionType
from tests.schedules._util import SCHEDULES

from ._util import compute, lowered, parse_lists


def test_interleaved_is_stage_mod_pp():
    p = StagePlacement.interleaved(4, 2)
    assert p.ranks == (0, 1, 2, 3, 0, 1, 2, 3) and (p.pp, p.vpp, p.num_stages) == (4, 2, 8)
    assert all(p.rank_of(s) == s % 4 for s in range(8))
    assert p.stages_of(1) == (1, 5)
    assert [p.chunk_of(s) for s in (0, 3, 4, 7)] == [0, 0, 1, 1]
    assert p.stage_at(1, 1) == 5 and StagePlacement.v(4).stage_at(1, 1) == 6


def test_v_holds_r_and_2pp_minus_1_minus_r():
    p = StagePlacement.v(4)
    assert p.ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    assert [p.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ScheduleError, match="got vpp=3; use --vpp 2"):
        StagePlacement.v(4, 3)


def test_placement_is_derived_from_the_schedule():
    assert placement_of("zbv", 3, 2) == StagePlacement.v(3)
    for name in [s for s in SCHEDULES if s != "zbv"]:
        assert placement_of(name, 3, 2) == StagePlacement.interleaved(3, 2)


def test_uneven_placement_rejected():
    with pytest.raises(ScheduleError, match="same number of stages"):
        StagePlacement(2, (0, 0, 1))
    with pytest.raises(ScheduleError, match="same number of stages"):
        StagePlacement(2, (0, 2))


def test_v_turn_needs_no_transfer():
    got = {r: " ".join(map(str, a)) for r, a in lowered("zbv", 2, 2, 2).items()}
    # stages 1 and 2 (the turn) share rank 1: 1F0 feeds 2F0, 2I0 feeds 1I0 directly;
    # the last stage, 3, is on rank 0 beside the first.
    assert got == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 3RECV_F0 3F0 3I0 3SEND_B0 3W0 3RECV_F1 3F1 3I1 "
           "3SEND_B1 3W1 0RECV_B0 0I0 0W0 0RECV_B1 0I1 0W1",
        1: "1RECV_F0 1F0 2F0 2SEND_F0 1RECV_F1 1F1 2F1 2SEND_F1 2RECV_B0 2I0 2W0 1I0 "
           "1SEND_B0 1W0 2RECV_B1 2I1 2W1 1I1 1SEND_B1 1W1",
    }


def test_v_order_under_interleaved_placement_is_refused():
    # zbv's order lowered as if interleaved: stage 3 is not rank 0's there
    acts = add_comm(compute("zbv", 2, 2, 2), 2)
    with pytest.raises(ScheduleError, match=r"virtual stage 3 is not one of its \(0, 2\)"):
        validate(acts, 2, 2, 2)


def test_placement_must_fit():
    with pytest.raises(ScheduleError, match="does not fit pp=3"):
        add_comm(parse_lists({0: "0F0 0B0"}), 3, placement=StagePlacement.v(2))
    with pytest.raises(ScheduleError, match="placement is for pp=2 vpp=2"):
        validate({0: []}, 2, 1, 1, placement=StagePlacement.v(2))


def test_default_placement_covers_edges():
    # one rank's list, the other end of its transfers on a rank not in the dict
    acts = add_comm(parse_lists({0: "0F0 2F0 2B0 0B0"}), 2)
    assert [str(a) for a in acts[0] if a.type.is_comm] == \
        ["0SEND_F0", "2RECV_F0", "2SEND_B0", "0RECV_B0"]
    assert acts[0][1].type is ActionType.SEND_F
