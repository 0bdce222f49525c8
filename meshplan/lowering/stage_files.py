"""Plan files of the ranks of one stage, each plan class lowered once.

`StageFiles(...).files(rank)` gives the rank's head file and its class's
body (`lowering/classes.py`): the first rank of a class is lowered (or its
body read from the plan cache) and its plan encoded as the class's body; a
later rank costs a head. Resolving the body at any rank equals lowering
that rank (tested rank by rank); a class lowered here is also checked once
at a second member, the one farthest along every free axis, lowered and
compared with the body resolved there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshplan.errors import PlanError
from meshplan.ir.fileio import read_bytes, write_atomic
from meshplan.ir.job import StageView
from meshplan.ir.mesh import Strategy
from meshplan.lowering.classes import encode, resolve
from meshplan.lowering.files import class_bytes, head_bytes, open_class
from meshplan.lowering.lower import lower


@dataclass(frozen=True)
class ClassFile:
    digest: str
    data: bytes       # the sealed body
    body: dict        # decoded
    cached: bool      # read from the plan cache, not lowered

    @property
    def summary(self) -> dict:
        """The class's plan in numbers: tasks, buffers, planned peak bytes."""
        b = self.body
        return {"tasks": len(b["tasks"]), "buffers": len(b["buffers"]),
                "planned_peak_bytes": dict(b["memory"]["peak"])["total"]}


class StageFiles:
    """Files of stage `stage`'s ranks; `view` decodes the stage when a class
    must be lowered; `cache`, if given, is a directory of class bodies."""

    def __init__(self, strategy: Strategy, stage: int, digest: str,
                 view: Callable[[], StageView], fixed: tuple[int, ...], device: str = "cpu",
                 cache: Path | None = None):
        self.strategy, self.stage, self.digest = strategy, stage, digest
        self._view = view
        self._decoded: StageView | None = None
        self.fixed, self.device, self.cache = fixed, device, cache
        self.place = strategy.placement(stage)
        self.classes: dict[tuple[int, ...], ClassFile] = {}
        self.seconds: dict[str, float] = {}  # of the last `files`: view, lower, serialize

    @property
    def view(self) -> StageView:
        if self._decoded is None:
            self._decoded = self._view()
        return self._decoded

    def files(self, rank: int) -> tuple[bytes, ClassFile, bool]:
        """`rank`'s head file; its class's body; whether this call made the body."""
        t0 = time.perf_counter()
        coord = self.place.coord(rank)
        key = tuple(coord[a] for a in self.fixed)
        made = key not in self.classes
        secs = {"view": 0.0, "lower": 0.0}
        if made:
            self.classes[key] = self._cached(key) or self._lowered(rank, coord, secs)
        klass = self.classes[key]
        head = head_bytes(klass.body, klass.digest, rank, coord, self.digest)
        secs["serialize"] = time.perf_counter() - t0 - secs["view"] - secs["lower"]
        self.seconds = secs
        return head, klass, made

    def _name(self, key) -> str:
        return f"class_{self.stage}" + "".join(f"_{c}" for c in key) + ".plan"

    def _cached(self, key) -> ClassFile | None:
        """The cached body of class `key`; None when absent or not that class
        (then it is lowered afresh and the entry replaced)."""
        if self.cache is None:
            return None
        path = self.cache / self._name(key)
        try:
            data = read_bytes(path)
            body = open_class(data, str(path))
        except PlanError:
            return None
        want = [[a, c] for a, c in zip(self.fixed, key)]
        if body.get("stage") != self.stage or body.get("fixed") != want \
                or body.get("device") != self.device:
            return None
        return ClassFile(*class_bytes(body), body, True)

    def _lowered(self, rank: int, coord, secs: dict) -> ClassFile:
        t0 = time.perf_counter()
        view = self.view
        t1 = time.perf_counter()
        body = encode(lower(view, rank, self.device), view, self.strategy, self.fixed)
        self._second_member(body, coord)
        secs["view"], secs["lower"] = t1 - t0, time.perf_counter() - t1
        klass = ClassFile(*class_bytes(body), body, False)
        if self.cache is not None:
            self.cache.mkdir(parents=True, exist_ok=True)
            write_atomic(self.cache / self._name(tuple(coord[a] for a in self.fixed)),
                         klass.data)
        return klass

    def _second_member(self, body: dict, coord: tuple[int, ...]) -> None:
        """The class's body resolved at its member farthest along every free
        axis equals that member's lowering (a broken symmetry is a bug here,
        not a wrong plan on a rank nobody looked at)."""
        far = tuple(c if a in self.fixed else n - 1
                    for a, (c, n) in enumerate(zip(coord, self.place.grid)))
        if far == coord:
            return
        rank, v = self.place.rank_at(far), self.view
        got = resolve(body, rank, far, self.digest, self.strategy, v.mesh.devices_per_node)
        assert got == lower(v, rank, self.device), \
            f"plan class of stage {self.stage} is not symmetric at rank {rank}"
