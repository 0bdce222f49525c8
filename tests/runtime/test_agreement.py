"""The distributed check (`runtime/agreement.py`) on 8 local gloo processes:
agreeing plans pass; a disagreement planted in one rank's plan stops every
rank before step 0, the ranks beside it naming it. (Its cost per rank is
measured in benchmarks/distributed_check.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lowering.jobs import job_of

ROOT = Path(__file__).resolve().parents[2]
NAME, WORLD = "gpt_2x4", 8  # dp2 tp2 pp2 vpp2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path, bad_rank: int = -1, bug: str = "") -> dict[int, dict]:
    job_path = tmp_path / "job.bin"
    job_path.write_bytes(job_of(NAME).to_bytes())
    port = _port()
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.runtime.agreement_ranks", str(job_path),
                               str(r), str(WORLD), str(port), str(bad_rank), bug or "-",
                               str(tmp_path)], cwd=ROOT, env=env, stderr=subprocess.PIPE)
             for r in range(WORLD)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-2000:]
    return {r: json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(WORLD)}


@pytest.mark.timeout(300)
def test_agreeing_plans_pass_and_a_planted_disagreement_stops_every_rank(tmp_path):
    good = run(tmp_path)
    assert all(v["verdict"] == "ok" for v in good.values())
    for bug, bad, named in (("box", 1, "rank 5 and this rank disagree on the pieces"),
                            ("order", 2, "of group"),
                            ("actions", 6, "ranks 6 of stage 1 run another action list")):
        out = tmp_path / bug
        out.mkdir()
        res = run(out, bad, bug)
        assert all(v["verdict"] != "ok" for v in res.values()), bug
        assert any(named in v["verdict"] for v in res.values()), (bug, res)
