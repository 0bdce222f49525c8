"""Typed results: `to_json()` has the keys and values the old dicts had, and
the read-only Mapping view agrees with it."""

from meshplan.driver.results import CompileResult, LowerResult, RunResult, steady_step_s
from meshplan.lowering.check import CheckResult, RankCheck

RANKS = {"0": {"planned_peak_bytes": 10, "measured_peak_bytes": 12}}


def test_run_result_json_is_the_old_dict():
    r = RunResult(losses=[2.0, 1.5], step_s=[0.1, 0.2], rank_losses={"1": [2.0, 1.5]},
                  median_step_s=0.15, ranks=RANKS, job_digest="abc", wall_s=3.0,
                  first_step=0, trace=None, state_slices={0: {}})
    old = {"losses": [2.0, 1.5], "grad_norms": [], "step_s": [0.1, 0.2],
           "rank_losses": {"1": [2.0, 1.5]}, "rank_grad_norms": {}, "skipped_steps": [],
           "median_step_s": 0.15, "ranks": RANKS, "job_digest": "abc", "wall_s": 3.0,
           "first_step": 0, "trace": None}
    assert r.to_json() == old and list(r.to_json()) == list(old)
    assert r == old and r["losses"] == r.losses and dict(r) == old
    clipped = RunResult(**{**r.__dict__, "rank_grad_norms": {"0": [3.0], "1": [3.0]}})
    assert clipped["grad_norms"] == [3.0]  # every rank's is the same: rank 0's is reported


def test_compile_result_json_is_the_old_dict():
    low = LowerResult(ranks={0: {"lower_s": 0.1}, 1: {"lower_s": 0.2}}, workers=2,
                      worker_maxrss_bytes=100, open_s=0.01, temp_signatures=3,
                      temp_rank_calls=4)
    stats = {"ranks": {0: {"lower_s": 0.1}, 1: {"lower_s": 0.2}}, "workers": 2,
             "worker_maxrss_bytes": 100, "open_s": 0.01,
             "temp_inference": {"signatures": 3, "rank_calls": 4}}
    assert low.to_json() == stats and list(low.to_json()) == list(stats)
    r = CompileResult(capture_s=1.0, master_s=2.0, passes_s={"propagate_sbp": 0.5},
                      job_digest="abc", lowering=low, logical_inference={"calls": 7},
                      master_temp_calls=5, master_maxrss_bytes=200)
    # the old compile_model's dict, built as it was (`**stats` keeps temp_inference)
    old = {"capture_s": 1.0, "master_s": 2.0, "passes_s": {"propagate_sbp": 0.5},
           "job_digest": "abc", **stats,
           "inference": {"logical": {"calls": 7},
                         "temp": {**stats["temp_inference"], "master_calls": 5}},
           "master_maxrss_bytes": 200}
    assert r.to_json() == old and list(r.to_json()) == list(old)


def test_check_result_json_is_the_old_dict():
    res = CheckResult(bubble_ratio=0.25, predicted_step_s=0.5,
                      ranks={1: RankCheck(64, {"param": 32}, 5, 6, 1)})
    assert res.to_json() == {
        "ok": True, "partial": False, "missing": "", "skipped": [], "errors": [],
        "bubble_ratio": 0.25, "predicted_step_s": 0.5,
        "ranks": {"1": {"planned_peak_bytes": 64, "peak_by_category": {"param": 32},
                        "tasks": 5, "buffers": 6, "stage": 1}}}


def test_the_steady_step_leaves_out_the_first_steps_warm_up():
    """The first step carries lazy kernel builds: 20 s against 0.06 s in a
    cold `--kernels inductor` run of 2 steps, whose plain median was 10 s."""
    assert steady_step_s([20.0, 0.06]) == 0.06
    assert steady_step_s([20.0, 0.06, 0.08, 0.07]) == 0.07
    assert steady_step_s([0.5]) == 0.5 and steady_step_s([]) is None
