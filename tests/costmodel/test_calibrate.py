"""`meshplan calibrate` (cli/calibrate_cmd.py, driver/calibrate.py): it writes a loadable
cpu-local model, atomically; a bad --out is one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.driver.calibrate import fit

ROOT = Path(__file__).resolve().parents[2]


def run(*args, home):
    env = os.environ | {"MESHPLAN_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "meshplan", *args], capture_output=True,
                          text=True, timeout=240, cwd=ROOT, env=env)


def test_calibrate_writes_a_model_that_loads(tmp_path):
    p = run("calibrate", "--quick", "--json", home=tmp_path)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    path = tmp_path / "devices" / "cpu-local.json"
    assert r["path"] == str(path) and path.is_file()
    assert [f.name for f in path.parent.iterdir()] == ["cpu-local.json"]  # no temp file left
    code = ("from meshplan.costmodel import load_device_model as f; d = f('cpu-local'); "
            "print(d.devices_per_node, d.host_cores, d.intra_bw == d.inter_bw, "
            "d.flops_for('float32') > 0)")
    env = os.environ | {"MESHPLAN_HOME": str(tmp_path)}
    q = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    cores = str(os.cpu_count())  # the ranks run here share its cores
    assert q.stdout.split() == [cores, cores, "True", "True"], q.stderr
    m = r["measured"]
    assert m["p2p_latency"] > 0 and m["all_reduce_bw"] > 0 and m["seconds"] < 60


def test_calibrate_into_a_directory_is_one_line(tmp_path):
    p = run("calibrate", "--quick", "--out", str(tmp_path), home=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is a directory" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_the_fit_inverts_the_two_rank_ring():
    # all-reduce of 2 ranks: 2 a + S / B; p2p one way: a + S / B (round trips timed)
    a, b, s = 50e-6, 2e9, 2**24
    raw = {"all_reduce_small": 2 * a + 4 / b, "all_reduce_large": 2 * a + s / b,
           "p2p_small": 2 * (a + 4 / b), "p2p_large": 2 * (a + s / b)}
    got = fit(raw, s)
    assert got["all_reduce_latency"] == pytest.approx(a, rel=1e-3)
    assert got["all_reduce_bw"] == pytest.approx(b, rel=1e-3)
    assert got["p2p_latency"] == pytest.approx(a, rel=1e-3)
    assert got["p2p_bw"] == pytest.approx(b, rel=1e-3)
