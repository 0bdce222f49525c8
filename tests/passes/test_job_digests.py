"""The Job's bytes are pinned: a refactor that must not change what is planned
keeps every digest (tests/goldens/job_digests.json, made by
benchmarks/job_digests.py, GPT-3 175B at 128 ranks included there). A change
that means to alter a Job regenerates the golden and says why."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import job_digests  # noqa: E402

GOLDEN = json.loads((ROOT / "tests/goldens/job_digests.json").read_text())


@pytest.mark.parametrize("name", sorted(job_digests.CASES))
def test_job_digest_unchanged(name):
    assert job_digests.digest(*job_digests.CASES[name]) == GOLDEN[name], (
        f"{name}: the Job changed; if meant, regenerate with "
        "python benchmarks/job_digests.py --big > tests/goldens/job_digests.json")


def test_golden_covers_the_big_case():
    assert set(GOLDEN) == set(job_digests.CASES) | set(job_digests.BIG)
