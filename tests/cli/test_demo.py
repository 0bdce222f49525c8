"""`meshplan demo`, as the README tells a user to run it (fewer steps)."""

import json
import subprocess
import sys

import pytest

from meshplan.lowering.files import read_dir
from meshplan.models import build_model, model_config
from tests.cli.test_pictures import assert_real_png
from tests.runtime.test_trace import assert_trace_covers_plans


@pytest.mark.slow
def test_demo_writes_its_pictures_and_the_measured_trace(tmp_path):
    out = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-m", "meshplan", "demo", "--out",
                        str(out), "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    # the demo's own 10 steps: losses of every loss-holding rank and every
    # parameter equal eager, and the learnable task's loss falls >= 30%
    assert r["ok"] and len(r["losses"]) == len(r["ref_losses"]) == 10, r["problems"]
    params = dict(build_model(model_config("gpt", "tiny"), device="meta").named_parameters())
    assert set(r["params"]) == set(params)
    assert r["loss_drop"] >= 0.3 and r["losses"][-1] <= 0.7 * r["losses"][0]
    assert r["max_abs_diff"] <= 1e-5  # (its wall time is the machine's, not a test's)
    assert set(r["files"]) == {"plans", "schedule", "trace", "losses", "summary"}
    assert_real_png(out / "schedule.png", min_colours=50)
    assert_real_png(out / "losses.png", min_colours=30)
    job, plans = read_dir(out / "plans")
    assert len(plans) == 8 and job.strategy.vpp == 2 and job.strategy.num_microbatches == 8
    assert_trace_covers_plans(json.loads((out / "trace.json").read_text()), plans)
    assert 0 <= r["trace"]["bubble_ratio"] and 0 < r["simulated"]["bubble_ratio"] < 1
    assert "training on 8 processes: 10/10" in p.stderr  # plain progress lines off a terminal


def test_a_bad_step_count_is_one_line():
    from tests.cli.test_cli import assert_user_error, run

    assert_user_error(run("-q", "demo", "--steps", "0"), "--steps")
