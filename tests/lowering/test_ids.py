"""ids: the 64-bit task id layout round-trips, and ids of ranks never collide."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshplan.lowering.ids import (
    DEVICE_INDEX_BITS,
    DEVICE_TYPE_BITS,
    INDEX_BITS,
    RANK_BITS,
    STREAM_BITS,
    TaskId,
    local_id,
    task_id,
)

BITS = (RANK_BITS, DEVICE_TYPE_BITS, DEVICE_INDEX_BITS, STREAM_BITS, INDEX_BITS)


def field(bits: int):
    return st.integers(0, (1 << bits) - 1)


task_ids = st.builds(TaskId, *(field(b) for b in BITS))


def test_layout_is_the_documented_one():
    assert BITS == (18, 3, 7, 15, 21) and sum(BITS) == 64


@given(task_ids)
def test_pack_unpack_round_trip(t):
    packed = t.pack()
    assert 0 <= packed < 1 << 64
    assert TaskId.unpack(packed) == t
    assert packed >> 46 == t.rank  # the rank sits in the top 18 bits


@given(task_ids, task_ids)
def test_distinct_fields_give_distinct_ids(a, b):
    assert (a.pack() == b.pack()) == (a == b)


def test_extremes():
    top = TaskId(*((1 << b) - 1 for b in BITS))
    assert top.pack() == (1 << 64) - 1
    assert TaskId(0, 0, 0, 0, 0).pack() == 0
    assert TaskId.unpack((1 << 64) - 1) == top


@pytest.mark.parametrize("which", range(5))
@pytest.mark.parametrize("value", ["over", "negative"])
def test_field_overflow_asserts(which, value):
    fields = [0] * 5
    fields[which] = 1 << BITS[which] if value == "over" else -1
    with pytest.raises(AssertionError, match="does not fit"):
        TaskId(*fields).pack()


@given(field(RANK_BITS), st.integers(0, (1 << 46) - 1))
def test_local_id_carries_its_rank(rank, counter):
    i = local_id(rank, counter)
    assert i >> 46 == rank and i & ((1 << 46) - 1) == counter and i < 1 << 64


def test_local_id_counter_overflow_asserts():
    with pytest.raises(AssertionError):
        local_id(0, 1 << 46)
    with pytest.raises(AssertionError):
        local_id(0, -1)


@given(field(RANK_BITS), st.integers(1, 1 << 7), field(STREAM_BITS), field(INDEX_BITS))
def test_task_id_derives_the_device_index(rank, devices_per_node, stream, op):
    t = TaskId.unpack(task_id(rank, devices_per_node, stream, op, device_type=1))
    assert t == TaskId(rank, 1, rank % devices_per_node, stream, op)
