"""Action records: string forms round-trip, default peers, parse errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.errors import ScheduleError
from meshplan.schedules.action import Action, ActionType

COMM = [t for t in ActionType if t.is_comm]


@st.composite
def actions(draw):
    atype = draw(st.sampled_from(list(ActionType)))
    if atype is ActionType.STEP:
        return Action.step()
    stage = draw(st.integers(0, 200))
    mb = draw(st.integers(0, 5000))
    if atype.is_compute:
        return Action(stage, atype, mb)
    peer = draw(st.one_of(st.just(-1), st.integers(0, 200).filter(lambda p: p != stage)))
    if peer == -1 and atype in (ActionType.RECV_F, ActionType.SEND_B) and stage == 0:
        peer = 1  # stage 0 has no chain neighbour below it
    return Action(stage, atype, mb, peer)


@settings(max_examples=300, deadline=None)
@given(actions())
def test_round_trip(a):
    assert Action.parse(str(a)) == a
    assert str(Action.parse(str(a))) == str(a)


@pytest.mark.parametrize("text", ["0F3", "2B1", "0SEND_F3", "1RECV_B0", "STEP", "0SEND_F3@2",
                                  "5RECV_F12@1", "12B0", "2I0", "2W0", "13I7", "0W12"])
def test_canonical_strings(text):
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("atype,peer", [(ActionType.SEND_F, 4), (ActionType.RECV_F, 2),
                                        (ActionType.SEND_B, 2), (ActionType.RECV_B, 4)])
def test_default_peer_is_chain_neighbour(atype, peer):
    a = Action(3, atype, 7)
    assert a.peer == peer and a.default_peer
    assert str(a) == f"3{atype.value}7"
    assert Action(3, atype, 7, peer) == a


def test_non_default_peer_written():
    a = Action(0, ActionType.SEND_F, 3, peer=2)
    assert str(a) == "0SEND_F3@2"
    assert Action.parse("0SEND_F3@2").peer == 2


@pytest.mark.parametrize("text", ["", "F3", "0F", "0X3", "0F3@1", "-1F0", "0send_f3", "STEP0",
                                  "0SEND_F3@", "0RECV_F0", "0SEND_F3@0", "1 F 2",
                                  "2I0@1", "2W", "0i0", "0UNSHARD"])
def test_parse_rejects_garbage(text):
    with pytest.raises(ScheduleError):
        Action.parse(text)


def test_parse_rejects_non_string():
    with pytest.raises(ScheduleError):
        Action.parse(3)


def test_bad_fields_rejected():
    with pytest.raises(ScheduleError):
        Action(0, ActionType.F, 1, peer=2)
    with pytest.raises(ScheduleError):
        Action(-1, ActionType.F, 0)
    with pytest.raises(ScheduleError):
        Action(0, ActionType.STEP, 0)


def test_kinds_and_helpers():
    assert ActionType.SEND_B.kind is ActionType.B and ActionType.RECV_F.kind is ActionType.F
    assert ActionType.F.is_compute and not ActionType.F.is_comm
    assert ActionType.RECV_B.is_recv and ActionType.SEND_F.is_send


def test_split_backward_kinds():
    i, w = ActionType.I, ActionType.W
    assert i.is_compute and w.is_compute and not i.is_comm
    assert (i.kind, w.kind) == (i, w)
    # the input gradient travels with B or I, W moves nothing
    assert [t.transfer for t in (ActionType.F, ActionType.B, i, w)] == \
        [ActionType.F, ActionType.B, ActionType.B, None]
    assert Action.parse("2I0") == Action(2, i, 0) and str(Action(2, w, 0)) == "2W0"
    with pytest.raises(ScheduleError):
        Action(2, i, 0, peer=1)
