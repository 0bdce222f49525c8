"""Schedules as CSV in torch's pipeline format: round trip, torch's own CSV, one-line errors."""

import pytest

from meshplan.errors import ScheduleError
from meshplan.ir.stage_placement import StagePlacement
from meshplan.schedules import placement_of
from meshplan.schedules.csv_io import dump_csv, load_csv

from ._util import ZB_GRID, compute, grid_id, lowered, parse_lists

# torch 2.13's ScheduleZBVZeroBubble(pp=2, m=4)._dump_csv(format="compute_only"):
# rank 1 starts with an empty cell, the step it waits for its first input.
TORCH_ZBV_2_4 = (
    "0F0,0F1,0F2,3F0,3I0,3W0,3F1,3I1,3W1,0F3,0I0,0W0,3F2,3I2,3W2,0I1,0W1,3F3,3I3,3W3,"
    "0I2,0W2,0I3,0W3\r\n"
    ",1F0,2F0,1F1,2F1,2I0,2W0,1F2,1I0,1W0,2F2,2I1,2W1,1F3,1I1,1W1,2F3,2I2,2W2,1I2,2I3,"
    "1I3,1W2,2W3,1W3\r\n")


@pytest.mark.parametrize("case", ZB_GRID[::4] + [("interleaved", 2, 2, 4), ("1f1b", 4, 1, 8)],
                         ids=grid_id)
def test_round_trip(case):
    name, pp, vpp, m = case
    orders = compute(*case)
    text = dump_csv(orders)
    assert len(text.splitlines()) == pp and "STEP" not in text
    assert load_csv(text, pp, vpp, m) == orders
    assert load_csv(text, pp, vpp, m, placement_of(name, pp, vpp)) == orders


def test_dump_lowered_and_step():
    acts = lowered("zbv", 2, 2, 1)
    acts = {r: [*a, *parse_lists({0: "STEP"})[0]] for r, a in acts.items()}
    rows = dump_csv(acts).splitlines()
    assert rows[1] == "1RECV_F0,1F0,2F0,2SEND_F0,2RECV_B0,2I0,2W0,1I0,1SEND_B0,1W0"


def test_torch_text_loads():
    orders = load_csv(TORCH_ZBV_2_4, 2, 2, 4)
    assert orders == compute("zbv", 2, 2, 4)


def test_torch_generates_the_same_csv(tmp_path):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

    class Stage:  # what the schedule classes read off a stage when building the order
        def __init__(self, pp):
            self.group_size, self.group_rank, self.num_stages = pp, 0, 2 * pp
            self.submod, self.stage_index_to_group_rank = None, None

    for cls, name, pp, m in [(schedules.ScheduleZBVZeroBubble, "zbv", 2, 4),
                             (schedules.ScheduleInterleavedZeroBubble, "zb1p", 4, 8)]:
        try:
            sched = cls([Stage(pp), Stage(pp)], m)
            sched._dump_csv(tmp_path / "s.csv", format="compute_only")
        except (AttributeError, TypeError) as e:  # private API moved
            pytest.skip(f"torch's {cls.__name__} cannot dump a CSV here: {e}")
        assert load_csv((tmp_path / "s.csv").read_text(), pp, 2, m) == compute(name, pp, 2, m)
        ours = [row.split(",") for row in dump_csv(compute(name, pp, 2, m)).splitlines()]
        assert [[str(schedules._Action.from_str(c)) for c in row] for row in ours] == ours


def bad(text: str, pp=2, vpp=2, m=2, placement=None) -> str:
    with pytest.raises(ScheduleError) as info:
        load_csv(text, pp, vpp, m, placement)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("bad schedule CSV: ")
    return msg


GOOD = dump_csv(compute("zbv", 2, 2, 2))  # row 1: 0F0,0F1,3F0,3I0,3W0,3F1,3I1,3W1,0I0,...


def edit(row: int, col: int, cell: str) -> str:
    rows = [r.split(",") for r in GOOD.splitlines()]
    rows[row][col - 1] = cell
    return "\n".join(",".join(r) for r in rows) + "\n"


def test_good_loads():
    assert GOOD.splitlines()[0].startswith("0F0,0F1,3F0,3I0,3W0,")
    load_csv(GOOD, 2, 2, 2)


def test_row_count():
    assert "3 rows for pp=2; rule: one row per rank" in bad(GOOD + "0F0\n")


def test_not_an_action():
    msg = bad(edit(0, 4, "3X0"))
    assert "row 1 (rank 0), column 4 ('3X0'): not an action; rule: a cell is" in msg
    assert "column 4 ('0UNSHARD')" in bad(edit(0, 4, "0UNSHARD"))


def test_comm_cell():
    assert "row 2 (rank 1), column 2 ('2SEND_F0'): not a compute action" in \
        bad(edit(1, 2, "2SEND_F0"))


def test_two_owners():
    msg = bad(edit(1, 1, "0F1"))
    assert "row 2 (rank 1), column 1 (0F1): stage 0 is also run by rank 0 (row 1, column 1); " \
           "rule: each stage has one owner rank" in msg


def test_stage_out_of_range_and_unowned():
    assert "column 1 (4F0): stage 4 is not in 0..3" in bad(edit(1, 1, "4F0"))
    one_stage = "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1F1,1I0,1W0,1I1,1W1\n"
    assert "no row runs stage 2; rule: every stage 0..3 has one owner rank" in bad(one_stage)


def test_rank_holds_wrong_count():
    text = ("0F0,1F0,2F0,2I0,2W0,1I0,1W0,0I0,0W0\n3F0,3I0,3W0\n")
    assert "row 1 (rank 0), end of row: rank 0 runs stages [0, 1, 2]; rule: each rank holds " \
        "vpp=2 stages" in bad(text, m=1)


def test_given_placement_owner():
    msg = bad(GOOD, placement=StagePlacement.interleaved(2, 2))
    assert "row 1 (rank 0), column 3 (3F0): stage 0 runs 3F0 but virtual stage 3 is not one " \
           "of its (0, 2); each virtual stage has one owner stage" in msg


def test_order_rules_name_the_column():
    swapped = GOOD.replace("3I0,3W0,3F1", "3W0,3I0,3F1", 1)
    assert "row 1 (rank 0), column 4 (3W0): stage 0 runs 3W0 before 3I0; W(v, mb) must follow " \
           "I(v, mb)" in bad(swapped)
    assert "column 5 (3B0): stage 0 runs 3B0 after 3I0; a (virtual stage, micro-batch) runs " \
           "B, or I then W" in bad(edit(0, 5, "3B0"))
    assert "column 3 (0F0): stage 0 runs 0F0 twice" in bad(edit(0, 3, "0F0"))
    assert "micro-batches are 0..1" in bad(edit(0, 1, "0F7"))


def test_incomplete_microbatch():
    msg = bad(GOOD.replace(",0W1", "", 1))
    assert "row 1 (rank 0), end of row: stage 0 runs 0I1 but never 0W1; every I needs its W" in msg
    assert "never runs 0F1" in bad(GOOD.replace("0F1,", "", 1).replace(",0I1,0W1", "", 1), m=2)


def test_deadlock_across_ranks():
    # Each row keeps the per-rank rules, but stage 0 waits for 0I0's input
    # gradient before running stage 3, on which that gradient depends.
    text = "0F0,0I0,0W0,3F0,3I0,3W0\n1F0,2F0,2I0,2W0,1I0,1W0\n"
    assert bad(text, m=1) == (
        "bad schedule CSV: row 1 (rank 0), column 2 (0I0): the schedule deadlocks: rank 0 waits "
        "here, rank 1 at column 3 (2I0); rule: no wait cycle across ranks (each input is sent "
        "before its consumer waits for it)")
