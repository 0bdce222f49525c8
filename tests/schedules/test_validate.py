"""The validator: every schedule on the grid passes; broken lists fail with a marked grid."""

import pytest

from meshplan.errors import ScheduleError
from meshplan.schedules import format_grid, validate
from meshplan.schedules.action import Action

from ._util import GRID, grid_id, lowered


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
    assert "<-- ERROR HERE (rank 1: 1F1)" in msg


def test_duplicated_forward():
    msg = broken(lambda a: a[0].insert(3, Action.parse("0F0")))
    assert "runs 0F0 twice" in msg and "<-- ERROR HERE (rank 0: 0F0)" in msg


def test_backward_before_forward():
    def swap(acts):
        i, j = acts[3].index(Action.parse("3F0")), acts[3].index(Action.parse("3B0"))
        acts[3][i], acts[3][j] = acts[3][j], acts[3][i]
    msg = broken(swap, pp=4, m=4)
    assert "3B0 before its forward 3F0" in msg and "<-- ERROR HERE (rank 3: 3B0)" in msg


def test_dropped_send():
    msg = broken(lambda a: a[1].remove(Action.parse("1SEND_B0")))
    assert "no rank posts the matching 1SEND_B0" in msg and "(rank 0: 0RECV_B0)" in msg


def test_send_before_compute():
    def move(acts):
        acts[0].remove(Action.parse("0SEND_F0"))
        acts[0].insert(0, Action.parse("0SEND_F0"))
    assert "sends 0SEND_F0 before computing 0F0" in broken(move)


def test_missing_compute():
    def drop(acts):
        acts[0].remove(Action.parse("0B1"))
    msg = broken(drop)
    assert "rank 0 never runs 0B1" in msg and "end of list" in msg


def test_wrong_rank_and_microbatch():
    assert "stage 1 is not one of its stages (0)" in broken(
        lambda a: a[0].insert(0, Action.parse("1F0")))
    assert "micro-batches are 0..1" in broken(lambda a: a[0].insert(0, Action.parse("0F5")))


def test_bad_rank_key():
    with pytest.raises(ScheduleError, match=r"ranks \[5\]"):
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
    assert "ranks hidden" in lines[0] and "rank 12" in lines[0]
    assert sum("<-- ERROR HERE" in line for line in lines) == 1
    assert lines[1].startswith("  ... 495 steps")


def test_grid_without_mark_shows_start():
    text = format_grid(lowered("gpipe", 2, 1, 1))
    assert text.splitlines()[1].split() == ["0", "0F0", "1RECV_F0"]
    assert "ERROR" not in text
