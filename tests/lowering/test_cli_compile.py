"""`meshplan compile` and `meshplan check` as a user runs them (subprocesses;
independent invocations run side by side to keep the suite fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshplan.lowering.files import plan_name
from tests.cli.test_cli import assert_user_error

MESH = ("--model", "gpt", "--size", "tiny", "--nodes", "2", "--devices-per-node", "4",
        "--tp", "2", "--pp", "2", "--vpp", "2", "--workers", "1")


def launch(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshplan", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(p: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    env = os.environ | {"MESHPLAN_CACHE_DIR": str(tmp / "cache")}
    full, part = tmp / "full", tmp / "part"
    wave = {"first": launch(env, "compile", *MESH, "--out", str(full), "--json"),
            "part": launch(env, "compile", *MESH, "--out", str(part), "--ranks", "0,5",
                           "--json", "--no-cache"),
            "check_none": launch(env, "check", str(tmp / "nonexistent"))}
    out = {k: finish(p) for k, p in wave.items()}
    # files are replaced atomically, so `check` may read `full` while it is rewritten
    wave = {"again": launch(env, "compile", *MESH, "--out", str(full), "--json"),
            "check": launch(env, "check", str(full), "--json"),
            "check_part": launch(env, "check", str(part), "--json")}
    out |= {k: finish(p) for k, p in wave.items()}
    return out, full, part


def compile_json(p) -> dict:
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_compile_reports_its_statistics(runs):
    r = compile_json(runs[0]["first"])
    assert r["capture_s"] >= 0 and r["master_s"] > 0
    assert sorted(r["ranks"], key=int) == [str(i) for i in range(8)]
    for v in r["ranks"].values():
        assert v["lower_s"] > 0 and v["cache_hit"] is False
        assert v["tasks"] > 0 and v["buffers"] > 0 and v["planned_peak_bytes"] > 0
    logical, temp = r["inference"]["logical"], r["inference"]["temp"]
    assert logical["calls"] >= logical["cache_hits"] >= 0 and logical["calls"] > 0
    # workspace: the master asks once per distinct signature, the ranks never
    assert temp["master_calls"] == temp["signatures"] and temp["rank_calls"] == 0
    for v in r["ranks"].values():
        assert set(v["parts_s"]) == {"view", "lower", "serialize", "write"}


def test_a_second_identical_compile_is_all_cache_hits(runs):
    first, again = compile_json(runs[0]["first"]), compile_json(runs[0]["again"])
    assert first["job_digest"] == again["job_digest"]
    assert all(v["cache_hit"] for v in again["ranks"].values())
    for r, v in again["ranks"].items():
        assert v["planned_peak_bytes"] == first["ranks"][r]["planned_peak_bytes"]
        assert v["tasks"] == first["ranks"][r]["tasks"]


def test_check_json(runs):
    p = runs[0]["check"]
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["ok"] is True and r["errors"] == []
    assert r["bubble_ratio"] > 0 and r["predicted_step_s"] > 0
    peaks = compile_json(runs[0]["first"])["ranks"]
    assert sorted(r["ranks"], key=int) == [str(i) for i in range(8)]
    for rank, v in r["ranks"].items():
        assert v["planned_peak_bytes"] == peaks[rank]["planned_peak_bytes"]


def test_compiling_some_ranks_writes_only_those(runs):
    part = runs[2]
    r = compile_json(runs[0]["part"])
    assert sorted(r["ranks"], key=int) == ["0", "5"]
    assert sorted(p.name for p in part.glob("*.plan")) == [plan_name(0), plan_name(5)]
    check = compile_json(runs[0]["check_part"])  # partial is not an error: exit 0
    assert (check["ok"], check["partial"], check["missing"]) == (True, True, "1-4, 6-7")
    assert "send/recv with the missing ranks" in check["skipped"]


def test_check_of_a_missing_directory(runs):
    assert_user_error(runs[0]["check_none"], "does not exist")
