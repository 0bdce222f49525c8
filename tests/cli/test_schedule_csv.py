"""Schedules as CSV: `show --csv` writes torch's pipeline CSV, `--schedule-csv`
reads a hand-written one back (checked, one line per mistake), and a
hand-written schedule trains equal to eager PyTorch."""

from __future__ import annotations

from meshplan.driver.plan import zoo_strategy
from meshplan.driver.verify import verify
from meshplan.ir.mesh import Mesh
from meshplan.lowering.files import read_dir
from meshplan.models import model_config
from meshplan.schedules import stage_placement
from tests.cli.test_cli import assert_user_error, run

FLAGS = ("--devices-per-node", "2", "--pp", "2", "--num-microbatches", "4")
# Written by hand: 1F1B's skeleton with the backward split, each rank's W's
# deferred to the end (the most a W can wait); stage 1 runs I then F.
HAND = ("0F0,0F1,,0F2,0I0,0F3,0I1,0I2,0I3,0W0,0W1,0W2,0W3\n"
        ",1F0,1I0,1F1,1I1,1F2,1I2,1F3,1I3,1W0,1W1,1W2,1W3\n")


def test_show_csv_round_trips_through_schedule_csv(tmp_path):
    a, b = tmp_path / "zbv", tmp_path / "back"
    assert run("compile", *FLAGS, "--schedule", "zbv", "--out", str(a)).returncode == 0
    compute, lowered = tmp_path / "c.csv", tmp_path / "l.csv"
    p = run("show", str(a), "--csv", str(compute))
    assert p.returncode == 0, p.stderr
    rows = compute.read_text().splitlines()
    assert len(rows) == 2 and rows[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0")
    assert "SEND" not in compute.read_text()
    assert run("show", str(a), "--csv", str(lowered), "--csv-comm").returncode == 0
    assert "0SEND_F0" in lowered.read_text()
    p = run("compile", *FLAGS, "--schedule-csv", str(compute), "--out", str(b))
    assert p.returncode == 0, p.stderr
    (job_a, plans_a), (job_b, plans_b) = read_dir(a), read_dir(b)
    assert stage_placement(job_b.strategy) == stage_placement(job_a.strategy)  # the V, read off
    assert all(plans_a[r].actions == plans_b[r].actions for r in plans_a)


def test_bad_csv_is_one_line_naming_rank_column_and_rule(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text(HAND.replace("0I0,0F3", "0W0,0F3", 1).replace("0I3,0W0", "0I3,0I0", 1))
    assert_user_error(run("plan", *FLAGS, "--schedule-csv", str(bad)),
                      "row 1 (rank 0), column 5 (0W0): stage 0 runs 0W0 before 0I0")
    short = tmp_path / "short.csv"
    short.write_text(HAND.replace(",1W3", ""))
    assert_user_error(run("plan", *FLAGS, "--schedule-csv", str(short)), "row 2 (rank 1)")
    assert_user_error(run("plan", *FLAGS, "--schedule-csv", str(tmp_path / "none.csv")),
                      "cannot read it")
    good = tmp_path / "good.csv"
    good.write_text(HAND)
    assert_user_error(run("plan", *FLAGS, "--schedule", "1f1b", "--schedule-csv", str(good)),
                      "give one")


def test_hand_written_csv_schedule_equals_eager(tmp_path):
    good = tmp_path / "hand.csv"
    good.write_text(HAND)
    p = run("plan", *FLAGS, "--schedule-csv", str(good), "--json")
    assert p.returncode == 0, p.stderr
    rows = [tuple(c for c in line.split(",") if c) for line in HAND.splitlines()]
    s = zoo_strategy("gpt", model_config("gpt", "tiny"), pp=2, global_batch_size=8,
                     micro_batch_size=2, schedule="csv", schedule_orders=tuple(rows))
    r = verify("gpt", "tiny", steps=6, mesh=Mesh(1, 2), strategy=s)
    assert r["ok"], r["problems"]
    assert r["max_abs_diff"] <= 1e-5 and r["params"] and r["optimizer_state"]
