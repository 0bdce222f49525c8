"""Zero-bubble compute orders against torch's (goldens/zero_bubble_orders.txt).

The golden is a copy of /work/shared/goldens/zero_bubble_orders.txt: the
per-rank compute orders of torch 2.13's ScheduleInterleavedZeroBubble
(our zb1p), ScheduleZBVZeroBubble (our zbv) and ScheduleDualPipeV, from each
class's pipeline_order. It is ground truth from torch, so --regen-goldens
never rewrites it from our code. DualPipeV is not a meshplan schedule (its
OVERLAP_F_B runs a forward and a backward together, which neither the
simulator nor the runtime can express); its sections are counted, not
compared.
"""

import re
from pathlib import Path

import pytest

from meshplan.schedules import compute_actions
from tests.schedules._util import ZERO_BUBBLE_SCHEDULES

GOLDEN = Path(__file__).parent / "goldens" / "zero_bubble_orders.txt"
OURS = {"ScheduleInterleavedZeroBubble": "zb1p", "ScheduleZBVZeroBubble": "zbv"}
NOT_OURS = {"ScheduleDualPipeV"}


def golden_cases() -> list[tuple[str, int, int, int, int, str]]:
    """(torch class, pp, vpp, m, rank, order) for every rank line of the golden."""
    cases, head = [], None
    for line in GOLDEN.read_text().splitlines():
        line = line.strip()
        if match := re.fullmatch(r"## (\w+) pp vpp m = (\d+) (\d+) (\d+)", line):
            head = (match.group(1), *(int(x) for x in match.groups()[1:]))
        elif match := re.fullmatch(r"rank (\d+): (.*)", line):
            assert head is not None, f"rank line before any header: {line!r}"
            cases.append((*head, int(match.group(1)), match.group(2).strip()))
        else:
            assert line.startswith("# ") or not line, f"unexpected golden line {line!r}"
    return cases


def test_golden_file_parses_fully():
    cases = golden_cases()
    assert len(cases) == 24
    assert {c[0] for c in cases} == set(OURS) | NOT_OURS
    ranks: dict[tuple, list[int]] = {}
    for cls, pp, vpp, m, rank, _ in cases:
        ranks.setdefault((cls, pp, vpp, m), []).append(rank)
    assert all(sorted(rs) == list(range(head[1])) for head, rs in ranks.items())
    assert sorted(OURS.values()) == sorted(ZERO_BUBBLE_SCHEDULES)


@pytest.mark.parametrize("cls,pp,vpp,m,rank,expected",
                         [c for c in golden_cases() if c[0] in OURS],
                         ids=lambda v: str(v) if not isinstance(v, str) or len(v) < 40 else "")
def test_orders_match_torch_golden(cls, pp, vpp, m, rank, expected):
    got = compute_actions(OURS[cls], pp, vpp, m, rank)
    assert " ".join(map(str, got)) == expected
