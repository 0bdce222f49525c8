"""Globally unique, deterministic ids for a rank's tasks, buffers and memory.

Task ids pack five fields into 64 bits, highest first (OneFlow's layout):

    rank 18 | device type 3 | device index 7 | stream 15 | task index 21

- task index = the Job op id the task comes from (so every rank derives the
  id of a peer's task without lowering the peer);
- stream = 0 compute, 1 collective, 2 + k for a send/recv with the k-th rank
  of the peer placement (one task per op and peer).
Buffer, memory-block and chunk ids are `(rank << 46) + local counter` (`LOCAL_BITS`).
Invariant: ids of different ranks can never collide, since the rank sits in
the top bits of every kind of id.
"""

from __future__ import annotations

from dataclasses import dataclass

# 18 rank bits: 262,144 ranks; 3 device-type bits: 8 types (2 named)
RANK_BITS, DEVICE_TYPE_BITS, DEVICE_INDEX_BITS, STREAM_BITS, INDEX_BITS = 18, 3, 7, 15, 21
COMPUTE_STREAM, COLLECTIVE_STREAM, P2P_STREAM = 0, 1, 2
LOCAL_BITS = 64 - RANK_BITS  # a buffer, block or chunk id: rank | counter
DEVICE_TYPES = {"cpu": 0, "cuda": 1}


@dataclass(frozen=True, slots=True)
class TaskId:
    rank: int
    device_type: int
    device_index: int
    stream: int
    index: int

    def pack(self) -> int:
        fields = ((self.rank, RANK_BITS), (self.device_type, DEVICE_TYPE_BITS),
                  (self.device_index, DEVICE_INDEX_BITS), (self.stream, STREAM_BITS),
                  (self.index, INDEX_BITS))
        out = 0
        for value, bits in fields:
            assert 0 <= value < (1 << bits), f"task id field {value} does not fit {bits} bits"
            out = (out << bits) | value
        return out

    @staticmethod
    def unpack(tid: int) -> TaskId:
        index = tid & ((1 << INDEX_BITS) - 1)
        tid >>= INDEX_BITS
        stream = tid & ((1 << STREAM_BITS) - 1)
        tid >>= STREAM_BITS
        device_index = tid & ((1 << DEVICE_INDEX_BITS) - 1)
        tid >>= DEVICE_INDEX_BITS
        device_type = tid & ((1 << DEVICE_TYPE_BITS) - 1)
        rank = tid >> DEVICE_TYPE_BITS
        return TaskId(rank, device_type, device_index, stream, index)


def task_id(rank: int, devices_per_node: int, stream: int, op_id: int,
            device_type: int = 0) -> int:
    """The packed id of the task of Job op `op_id` on `rank`'s `stream`
    (`TaskId.pack`, without building one: lowering asks it for every task)."""
    assert 0 <= rank < 1 << RANK_BITS and 0 <= device_type < 1 << DEVICE_TYPE_BITS
    assert 0 <= stream < 1 << STREAM_BITS and 0 <= op_id < 1 << INDEX_BITS
    assert devices_per_node <= 1 << DEVICE_INDEX_BITS
    device = (rank << DEVICE_TYPE_BITS | device_type) << DEVICE_INDEX_BITS | rank % devices_per_node
    return (device << STREAM_BITS | stream) << INDEX_BITS | op_id


def local_id(rank: int, counter: int) -> int:
    """A buffer, memory-block or chunk id: `(rank << LOCAL_BITS) + counter`."""
    assert 0 <= counter < (1 << LOCAL_BITS)
    return (rank << LOCAL_BITS) + counter
