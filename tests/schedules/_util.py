"""Shared helpers for the schedule tests: build, lower and simulate a schedule."""

from __future__ import annotations

from meshplan.schedules import REGISTRY, add_comm, compute_actions, placement_of
from meshplan.schedules.action import Action
from meshplan.schedules.simulate import simulate

SCHEDULES = sorted(name for name, spec in REGISTRY.items() if spec.actions is not None)
ZERO_BUBBLE_SCHEDULES = [name for name in SCHEDULES if REGISTRY[name].splits_backward]

# The (schedule, pp, vpp, num_microbatches) grid every B schedule is checked on.
GRID = [
    (name, pp, vpp, k * pp)
    for name in SCHEDULES if not REGISTRY[name].splits_backward
    for pp in (1, 2, 3, 4, 8)
    for vpp in ((1, 2, 3) if name == "interleaved" else (1,))
    for k in (1, 2, 4)
]

# The same grid for the zero-bubble schedules (I/W split; zbv takes vpp 2 only).
ZB_GRID = [
    (name, pp, vpp, k * pp)
    for name in ZERO_BUBBLE_SCHEDULES
    for pp in (1, 2, 3, 4, 8)
    for vpp in ((1, 2, 3) if name == "zb1p" else (2,))
    for k in (1, 2, 4)
]


def grid_id(case: tuple[str, int, int, int]) -> str:
    name, pp, vpp, m = case
    return f"{name}-pp{pp}-vpp{vpp}-m{m}"


def compute(name: str, pp: int, vpp: int, m: int) -> dict[int, list[Action]]:
    return {r: compute_actions(name, pp, vpp, m, r) for r in range(pp)}


def lowered(name: str, pp: int, vpp: int, m: int) -> dict[int, list[Action]]:
    return add_comm(compute(name, pp, vpp, m), pp, placement=placement_of(name, pp, vpp))


def parse_lists(text: dict[int, str]) -> dict[int, list[Action]]:
    """{rank: "0F0 0SEND_F0 ..."} -> {rank: [Action, ...]}."""
    return {r: [Action.parse(s) for s in line.split()] for r, line in text.items()}


def run(name: str, pp: int, vpp: int, m: int, **costs):
    return simulate(lowered(name, pp, vpp, m), pp, placement=placement_of(name, pp, vpp), **costs)
