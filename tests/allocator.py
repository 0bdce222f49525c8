"""The CPU allocator's peak, from torch's profiler memory events: every
tensor the profiling thread allocates, a kernel's own temporaries included
(what `LiveBytes`, counting the tensors the executor holds, cannot see).

The profiler sees no allocation made before it starts (a free of one is
not counted either), and none made on another thread: start it before
anything measured is made, and run the step on the calling thread."""

from __future__ import annotations

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

_MARK = 7919  # bytes of the marker allocation: a size nothing else takes


class AllocatorPeak:
    """`with AllocatorPeak() as a: ...; a.mark(); ...` then `a.peak()`: the
    most bytes allocated while it profiles that are alive at once after the
    last mark (those made before the mark included)."""

    def __enter__(self):
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)

    def mark(self) -> None:
        torch.empty(_MARK, dtype=torch.uint8)

    def peak(self) -> int:
        events = sorted((e for e in _walk(self._prof.profiler.kineto_results
                                          .experimental_event_tree())
                         if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
        # counted here, not by the events' own running total: torch keeps that
        # from one profiling to the next, with what an earlier one left
        live: dict[int, int] = {}
        total = best = 0
        for e in events:
            f = e.extra_fields
            if f.alloc_size > 0:
                live[f.ptr] = f.alloc_size
                total += f.alloc_size
            else:
                total -= live.pop(f.ptr, 0)
            if f.alloc_size == _MARK:
                best = 0
                continue
            best = max(best, total)
        return best


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


def peak_of(fn) -> int:
    """The most bytes `fn()` allocates at once, beyond what is live before it."""
    with AllocatorPeak() as a:
        fn()
    return a.peak()
