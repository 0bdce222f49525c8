"""`meshplan plan`: the report, and one clear ConfigError per bad strategy."""

import json

import pytest

from meshplan.models import build_model, model_config
from tests.cli.test_cli import assert_user_error, run


def test_plan_json_report():
    p = run("plan", "--model", "gpt", "--nodes", "2", "--devices-per-node", "4", "--tp", "2",
            "--pp", "2", "--vpp", "2", "--global-batch-size", "16", "--micro-batch-size", "2",
            "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert (r["dp"], r["tp"], r["pp"], r["vpp"], r["num_microbatches"]) == (2, 2, 2, 2, 4)
    assert [(c["stage"], c["chunk"], c["layers"]) for c in r["chunks"]] == [
        (0, 0, ["blocks.0"]), (0, 1, ["blocks.2"]), (1, 0, ["blocks.1"]), (1, 1, ["blocks.3"])]
    # One forward transfer per boundary between consecutive chunks, one
    # data-parallel gradient all-reduce per parameter.
    assert r["comm_counts"]["transfer/pp/forward"] == r["pp"] * r["vpp"] - 1
    params = list(build_model(model_config("gpt", "tiny"), device="meta").parameters())
    assert r["comm_counts"]["all_reduce/dp/optimizer"] == len(params)
    assert all({"kind", "axis", "bytes", "phase"} <= set(c) for c in r["comm"])
    assert r["totals_per_step"]["comm_bytes"] > 0


def test_plan_table_and_non_monotone_note():
    p = run("plan", "--model", "gpt", "--devices-per-node", "2", "--pp", "2",
            "--layer-stages", "0,1,1,0", "--global-batch-size", "4", "--micro-batch-size", "1")
    assert p.returncode == 0, p.stderr
    assert "stage chunk" in p.stdout and "note:" in p.stdout and "not monotone" in p.stdout


def test_stage_layers_balanced_is_planned_by_cost():
    """`--stage-layers balanced`: the layers per virtual stage the cost
    model balances (the embedding and head weigh on the ends), noted."""
    p = run("plan", "--model", "gpt", "--layers", "8", "--vocab", "8192", "--devices-per-node", "2",
            "--pp", "2",
            "--vpp", "2", "--stage-layers", "balanced", "--global-batch-size", "4", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    chunks = sorted(r["chunks"], key=lambda c: c["chunk"] * 2 + c["stage"])
    counts = [len(c["layers"]) for c in chunks]
    assert sum(counts) == 8 and counts[-1] < counts[0] and min(counts) >= 1, counts
    assert any("stage_layers balanced = " in n for n in r["notes"]), r["notes"]
    assert_user_error(run("plan", "--stage-layers", "auto"), "is not a comma-separated list")


@pytest.mark.parametrize("args, phrase", [
    (("--devices-per-node", "4", "--dp", "1", "--tp", "2", "--pp", "1"), "dp*tp*pp = 1*2*1 = 2"),
    (("--devices-per-node", "3", "--tp", "3"), "tp=3 does not divide heads=4"),
    (("--devices-per-node", "3", "--pp", "3"), "valid pp values"),
    (("--devices-per-node", "2", "--pp", "2", "--vpp", "3", "--num-microbatches", "4"),
     "valid vpp values: 1, 2"),
    (("--layer-pattern", r"layers\.(\d+)"), "matches no"),
    (("--devices-per-node", "2", "--pp", "2", "--layer-stages", "0,1,1"), "4 layers"),
    (("--devices-per-node", "2", "--pp", "2", "--num-microbatches", "1"),
     "needs num_microbatches >= pp"),
    (("--global-batch-size", "7", "--micro-batch-size", "2"), "not a multiple"),
])
def test_bad_strategies_are_one_line_config_errors(args, phrase):
    assert_user_error(run("plan", *args), phrase)
