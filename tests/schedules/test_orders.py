"""Compute orders: explicit GPipe/1F1B orders, interleaved goldens, count checks.

The interleaved golden (goldens/interleaved_1f1b_orders.txt, a copy of
/work/shared/goldens/) is torch.distributed.pipelining's
ScheduleInterleaved1F1B order. It is ground truth from torch, so
--regen-goldens never rewrites it from our code.
"""

import re
from pathlib import Path

import pytest

from meshplan.errors import ScheduleError
from meshplan.schedules import REGISTRY, compute_actions
from meshplan.schedules.interleaved import interleaved_warmup, schedule_interleaved

GOLDEN = Path(__file__).parent / "goldens" / "interleaved_1f1b_orders.txt"


def order(name, pp, vpp, m, rank) -> str:
    return " ".join(map(str, compute_actions(name, pp, vpp, m, rank)))


def test_gpipe_order():
    assert order("gpipe", 4, 1, 8, 0) == ("0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 "
                                          "0B0 0B1 0B2 0B3 0B4 0B5 0B6 0B7")
    assert order("gpipe", 4, 1, 8, 3) == ("3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 "
                                          "3B0 3B1 3B2 3B3 3B4 3B5 3B6 3B7")


def test_1f1b_order():
    assert order("1f1b", 4, 1, 8, 0) == ("0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 "
                                         "0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7")
    assert order("1f1b", 4, 1, 8, 3) == ("3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 "
                                         "3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7")
    assert order("1f1b", 4, 1, 4, 1) == "1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3"


def golden_cases() -> list[tuple[int, int, int, int, str]]:
    cases, head = [], None
    for line in GOLDEN.read_text().splitlines():
        if match := re.fullmatch(r"## pp vpp m = (\d+) (\d+) (\d+)", line.strip()):
            head = tuple(int(x) for x in match.groups())
        elif match := re.fullmatch(r"rank (\d+): (.*)", line.strip()):
            assert head is not None, f"rank line before any header: {line!r}"
            cases.append((*head, int(match.group(1)), match.group(2).strip()))
    return cases


def test_golden_file_parses_fully():
    cases = golden_cases()
    assert len(cases) == 17
    ranks: dict[tuple[int, int, int], list[int]] = {}
    for pp, vpp, m, rank, _ in cases:
        ranks.setdefault((pp, vpp, m), []).append(rank)
    assert all(sorted(rs) == list(range(head[0])) for head, rs in ranks.items())


@pytest.mark.parametrize("pp,vpp,m,rank,expected", golden_cases(),
                         ids=lambda v: str(v) if not isinstance(v, str) else "")
def test_interleaved_matches_torch_golden(pp, vpp, m, rank, expected):
    assert order("interleaved", pp, vpp, m, rank) == expected


def test_interleaved_warmup_formula():
    assert [interleaved_warmup(4, 2, 8, r) for r in range(4)] == [10, 8, 6, 4]
    assert interleaved_warmup(4, 2, 4, 0) == 8  # capped at vpp * m


def test_interleaved_vpp1_differs_from_1f1b_so_compute_actions_falls_back():
    # torch's formula warms up 2*(pp-r-1) forwards at vpp=1, 1F1B pp-r-1.
    raw = " ".join(map(str, schedule_interleaved(4, 1, 8, 0)))
    assert raw == "0F0 0F1 0F2 0F3 0F4 0F5 0F6 0B0 0F7 0B1 0B2 0B3 0B4 0B5 0B6 0B7"
    assert raw != order("1f1b", 4, 1, 8, 0)
    for pp in (1, 2, 3, 4, 8):
        for m in (pp, 2 * pp, 4 * pp):
            for r in range(pp):
                assert order("interleaved", pp, 1, m, r) == order("1f1b", pp, 1, m, r)


@pytest.mark.parametrize("name", sorted(n for n, s in REGISTRY.items()
                                         if s.actions and not s.splits_backward))
def test_every_stage_and_microbatch_once(name):
    pp, m = 4, 8
    for vpp in (1, 2, 3) if name == "interleaved" else (1,):
        for r in range(pp):
            acts = compute_actions(name, pp, vpp, m, r)
            keys = [(a.type, a.virtual_stage, a.microbatch) for a in acts]
            assert len(keys) == len(set(keys)) == 2 * vpp * m
            assert {a.virtual_stage for a in acts} == {c * pp + r for c in range(vpp)}


def test_1f1b_needs_enough_microbatches():
    with pytest.raises(ScheduleError, match=r"num_microbatches=3 pp=4.*--num-microbatches 4"):
        compute_actions("1f1b", 4, 1, 3, 0)


def test_interleaved_needs_multiple_of_pp():
    with pytest.raises(ScheduleError, match=r"num_microbatches=6 pp=4.*--num-microbatches 4 or 8"):
        compute_actions("interleaved", 4, 2, 6, 0)
    with pytest.raises(ScheduleError, match=r"num_microbatches=2 pp=4.*--num-microbatches 4"):
        compute_actions("interleaved", 4, 2, 2, 0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_vpp_needs_interleaved(name):
    with pytest.raises(ScheduleError, match="--schedule interleaved"):
        compute_actions(name, 2, 2, 4, 0)


@pytest.mark.parametrize("args", [("zb", 2, 1, 4, 0), ("gpipe", 0, 1, 4, 0),
                                  ("gpipe", 2, 1, 0, 0), ("gpipe", 2, 0, 4, 0),
                                  ("gpipe", 2, 1, 4, 2), ("gpipe", 2, 1, 4, -1)])
def test_bad_arguments(args):
    with pytest.raises(ScheduleError):
        compute_actions(*args)
