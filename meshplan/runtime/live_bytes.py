"""Measured live bytes: every tensor the executor holds, by storage.

Invariant: a storage counts once however many values view it, from its first
reference to its last; `peak` is the high-water mark of `live`.
"""

from __future__ import annotations

import torch


class LiveBytes:
    """Reference-counts storages and tracks live and peak bytes."""

    __slots__ = ("live", "peak", "_count")

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._count: dict[int, list[int]] = {}

    def add(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        entry = self._count.get(key)
        if entry is None:
            n = st.nbytes()
            self._count[key] = [1, n]
            self.live += n
            if self.live > self.peak:
                self.peak = self.live
        else:
            entry[0] += 1

    def transient(self, nbytes: int) -> None:
        """`nbytes` held for a moment on top of what is live (a built run's
        own buffers and outputs, measured: `fused.InductorRun`)."""
        if self.live + nbytes > self.peak:
            self.peak = self.live + nbytes

    def drop(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        key = t.untyped_storage().data_ptr()
        entry = self._count.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._count[key]
