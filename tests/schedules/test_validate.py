"""The validator: every schedule on the grid passes; broken lists fail with a marked grid."""

import pytest

from meshplan.errors import ScheduleError
from meshplan.schedules import format_grid, placement_of, validate
from meshplan.schedules.action import Action
from meshplan.schedules.validate import find_fault

from ._util import GRID, compute, grid_id, lowered


@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_grid_validates(case):
    validate(lowered(*case), *case[1:])


def broken(edit, name="1f1b", pp=2, m=2):
    acts = {r: list(a) for r, a in lowered(name, pp, 1, m).items()}
    edit(acts)
    with pytest.raises(ScheduleError) as info:
        validate(acts, pp, 1, m)
    msg = str(info.value)
    assert "<-- ERROR HERE" in msg
    return msg


def test_dropped_recv():
    msg = broken(lambda a: a[1].remove(Action.parse("1RECV_F1")))
    assert "before receiving its input 1RECV_F1" in msg
    assert "<-- ERROR HERE (stage 1: 1F1)" in msg


def test_duplicated_forward():
    msg = broken(lambda a: a[0].insert(3, Action.parse("0F0")))
    assert "runs 0F0 twice" in msg and "<-- ERROR HERE (stage 0: 0F0)" in msg


def test_backward_before_forward():
    def swap(acts):
        i, j = acts[3].index(Action.parse("3F0")), acts[3].index(Action.parse("3B0"))
        acts[3][i], acts[3][j] = acts[3][j], acts[3][i]
    msg = broken(swap, pp=4, m=4)
    assert "3B0 before its forward 3F0" in msg and "<-- ERROR HERE (stage 3: 3B0)" in msg


def test_dropped_send():
    msg = broken(lambda a: a[1].remove(Action.parse("1SEND_B0")))
    assert "no stage posts the matching 1SEND_B0" in msg and "(stage 0: 0RECV_B0)" in msg


def test_send_before_compute():
    def move(acts):
        acts[0].remove(Action.parse("0SEND_F0"))
        acts[0].insert(0, Action.parse("0SEND_F0"))
    assert "sends 0SEND_F0 before computing 0F0" in broken(move)


def test_missing_compute():
    def drop(acts):
        acts[0].remove(Action.parse("0B1"))
    msg = broken(drop)
    assert "stage 0 never runs 0B1" in msg and "end of list" in msg


def test_wrong_rank_and_microbatch():
    assert "virtual stage 1 is not one of its (0)" in broken(
        lambda a: a[0].insert(0, Action.parse("1F0")))
    assert "micro-batches are 0..1" in broken(lambda a: a[0].insert(0, Action.parse("0F5")))


def test_bad_rank_key():
    with pytest.raises(ScheduleError, match=r"stages \[5\]"):
        validate({5: []}, 2, 1, 1)


def test_same_rank_order_pp1():
    acts = {0: [Action.parse(s) for s in "1F0 0F0 1B0 0B0".split()]}
    with pytest.raises(ScheduleError, match="runs 1F0 before 0F0"):
        validate(acts, 1, 2, 1)


def test_grid_is_bounded():
    acts = lowered("interleaved", 8, 3, 32)
    acts.update({r + 8: list(acts[r]) for r in range(8)})  # 16 columns
    text = format_grid(acts, mark=(12, 500))
    lines = text.splitlines()
    assert len(lines) <= 16 and max(map(len, lines)) < 160
    assert "stages hidden" in lines[0] and "stage 12" in lines[0]
    assert sum("<-- ERROR HERE" in line for line in lines) == 1
    assert lines[1].startswith("  ... 495 steps")


def test_grid_without_mark_shows_start():
    text = format_grid(lowered("gpipe", 2, 1, 1))
    assert text.splitlines()[1].split() == ["0", "0F0", "1RECV_F0"]
    assert "ERROR" not in text


def broken_split(edit, m=2):
    """zb1p pp=2 vpp=1 lowered, edited, must fail validate; returns the message."""
    acts = {r: list(a) for r, a in lowered("zb1p", 2, 1, m).items()}
    edit(acts)
    with pytest.raises(ScheduleError) as info:
        validate(acts, 2, 1, m)
    return str(info.value)


def test_split_grid_passes_unedited():
    validate(lowered("zb1p", 2, 1, 2), 2, 1, 2)


def swap(rank: int, x: str, y: str):
    def edit(acts):
        i, j = acts[rank].index(Action.parse(x)), acts[rank].index(Action.parse(y))
        acts[rank][i], acts[rank][j] = acts[rank][j], acts[rank][i]
    return edit


def test_w_before_i():
    msg = broken_split(swap(1, "1I0", "1W0"))
    assert "stage 1 runs 1W0 before 1I0; W(v, mb) must follow I(v, mb)" in msg
    assert "<-- ERROR HERE (stage 1: 1W0)" in msg


def test_i_before_f():
    msg = broken_split(swap(1, "1F1", "1I1"))
    assert "stage 1 runs 1I1 before its forward 1F1; I(v, mb) must follow F(v, mb)" in msg


def test_w_never_runs():
    msg = broken_split(lambda a: a[0].remove(Action.parse("0W1")))
    assert "stage 0 runs 0I1 but never 0W1; every I needs its W (as many I as W)" in msg
    assert "(stage 0: end of list)" in msg


def test_w_without_i():
    def drop_i(acts):
        i = acts[1].index(Action.parse("1I0"))
        acts[1][i] = Action.parse("1B0")  # B in place of I: its W is then not allowed
    msg = broken_split(drop_i)
    assert "stage 1 runs 1W0 after 1B0; a (virtual stage, micro-batch) runs B, or I then W, " \
           "not both" in msg


def test_b_beside_i():
    msg = broken_split(lambda a: a[0].append(Action.parse("0B1")))
    assert "stage 0 runs 0B1 after 0I1; a (virtual stage, micro-batch) runs B, or I then W" in msg


def test_duplicated_w():
    msg = broken_split(lambda a: a[1].append(Action.parse("1W1")))
    assert "stage 1 runs 1W1 twice" in msg


def test_no_backward_at_all():
    def drop(acts):
        acts[0].remove(Action.parse("0I1"))
        acts[0].remove(Action.parse("0W1"))
        acts[0].remove(Action.parse("0RECV_B1"))
        acts[1].remove(Action.parse("1SEND_B1"))
    msg = broken_split(drop)
    assert "stage 0 never runs 0B1 (nor 0I1 and 0W1); every (virtual stage, micro-batch) " \
           "needs one backward: B, or I then W" in msg


def test_input_gradient_needs_i_not_w():
    # rank 0's RECV_B waits for rank 1's SEND_B, which must follow 1I0 (not 1W0)
    def move(acts):
        acts[1].remove(Action.parse("1SEND_B0"))
        acts[1].insert(acts[1].index(Action.parse("1F0")) + 1, Action.parse("1SEND_B0"))
    assert "sends 1SEND_B0 before computing 1B0" in broken_split(move)


def test_compute_only_order_checks_same_rank_only():
    orders = compute("zbv", 2, 2, 2)
    v = placement_of("zbv", 2, 2)
    assert find_fault(orders, 2, 2, 2, placement=v, lowered=False) is None
    orders[1] = [a for a in orders[1] if str(a) != "2F0"] + [Action.parse("2F0")]
    fault = find_fault(orders, 2, 2, 2, placement=v, lowered=False)
    assert fault.stage == 1 and "stage 1 runs 2I0 before its forward 2F0" in fault.message
    lowered_acts = lowered("zbv", 2, 2, 2)
    fault = find_fault(lowered_acts, 2, 2, 2, placement=v, lowered=False)
    assert fault.index == 1 and "a compute order holds F, B, I and W only" in fault.message
