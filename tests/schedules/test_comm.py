"""The shared comm lowering: SEND right after the producer, RECV right before the consumer."""

import pytest

from meshplan.errors import ScheduleError
from meshplan.schedules import add_comm, chain_edges, validate
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.sendrecv import Transfer

from ._util import compute, lowered, parse_lists


def strs(actions):
    return {r: " ".join(map(str, acts)) for r, acts in actions.items()}


def test_gpipe_pp2_m2():
    assert strs(lowered("gpipe", 2, 1, 2)) == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        1: "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    }


def test_interleaved_pp2_vpp2_rank0_wraps_around():
    got = strs(lowered("interleaved", 2, 2, 2))
    # stage 2 (rank 0) consumes F of stage 1 (rank 1) and feeds B back to it.
    assert got[0].split()[:6] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "2RECV_F0", "2F0"]
    assert "2B0 2SEND_B0" in got[0] and "1RECV_B0 1B0" in got[1]
    assert "3B0 3SEND_B0" in got[1]  # last stage starts the backward chain


def test_same_rank_transfers_need_no_actions():
    acts = lowered("interleaved", 1, 3, 2)
    assert all(a.type.is_compute for a in acts[0])
    assert acts[0] == compute("interleaved", 1, 3, 2)[0]


def test_chain_edges():
    assert chain_edges(3) == [Transfer(ActionType.F, 0, 1), Transfer(ActionType.F, 1, 2),
                              Transfer(ActionType.B, 1, 0), Transfer(ActionType.B, 2, 1)]
    assert chain_edges(1) == []


def test_custom_edges_skip_connection():
    edges = chain_edges(3) + [(0, 2, "F"), (2, 0, "B")]
    acts = add_comm(compute("gpipe", 3, 1, 2), 3, edges)
    assert strs(acts)[0].startswith("0F0 0SEND_F0 0SEND_F0@2 0F1")
    assert strs(acts)[2].startswith("2RECV_F0 2RECV_F0@0 2F0")
    assert "0RECV_B0 0RECV_B0@2 0B0" in strs(acts)[0]
    validate(acts, 3, 1, 2, edges=edges)
    with pytest.raises(ScheduleError, match="no cross-stage F transfer from virtual stage 0 to 2"):
        validate(acts, 3, 1, 2)  # the default chain has no skip edge


def test_step_passes_through():
    comp = compute("gpipe", 2, 1, 1)
    comp = {r: [*acts, Action.step()] for r, acts in comp.items()}
    acts = add_comm(comp, 2)
    assert all(str(acts[r][-1]) == "STEP" for r in acts)
    validate(acts, 2, 1, 1)


def test_rejects_lowered_input_and_bad_edges():
    with pytest.raises(ScheduleError, match="compute actions only"):
        add_comm(lowered("gpipe", 2, 1, 1), 2)
    with pytest.raises(ScheduleError, match="bad transfer"):
        add_comm(compute("gpipe", 2, 1, 1), 2, [(0, 1, "X")])
    with pytest.raises(ScheduleError, match="bad transfer"):
        add_comm(compute("gpipe", 2, 1, 1), 2, [(0, 0, "F")])


def test_deterministic():
    assert lowered("interleaved", 4, 2, 8) == lowered("interleaved", 4, 2, 8)
    assert parse_lists(strs(lowered("1f1b", 4, 1, 4))) == lowered("1f1b", 4, 1, 4)


def test_input_gradient_leaves_with_i_and_w_moves_nothing():
    got = strs(lowered("zb1p", 2, 1, 2))
    assert got == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0W0 0RECV_B1 0I1 0W1",
        1: "1RECV_F0 1F0 1I0 1SEND_B0 1RECV_F1 1F1 1I1 1SEND_B1 1W0 1W1",
    }


def test_b_and_i_mixed_on_one_rank():
    acts = add_comm(parse_lists({0: "0F0 0F1 0B0 0I1 0W1", 1: "1F0 1B0 1F1 1I1 1W1"}), 2)
    assert strs(acts) == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0I1 0W1",
        1: "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1I1 1SEND_B1 1W1",
    }
