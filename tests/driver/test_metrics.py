"""A run's numbers: metrics.jsonl rows (strict JSON), append for a resumed
run, and TensorBoard scalars that read back as logged."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from meshplan.driver import metrics
from meshplan.driver.metrics import MetricsLog, read_metrics, read_tensorboard
from meshplan.errors import ConfigError

TRAIN = {"step", "kind", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_s",
         "peak_bytes"}


def _train(log: MetricsLog, step: int, loss: float) -> None:
    log.log_train(step, loss, grad_norm=0.5 + step, lr=1e-3 * (step + 1), tokens_per_s=1000.0,
                  mfu=None, step_s=0.25, peak_bytes=2**30 + step)


def test_rows_have_exactly_their_keys(tmp_path):
    with MetricsLog(tmp_path, tensorboard=False) as log:
        _train(log, 0, 5.0)
        _train(log, 1, 4.5)
        log.log_eval(1, 4.0)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["kind"] for r in rows] == ["train", "train", "eval"]
    assert set(rows[0]) == TRAIN and rows[0]["mfu"] is None
    assert rows[1] == {"kind": "train", "step": 1, "loss": 4.5, "grad_norm": 1.5, "lr": 2e-3,
                       "tokens_per_s": 1000.0, "mfu": None, "step_s": 0.25,
                       "peak_bytes": 2**30 + 1}
    assert rows[2] == {"kind": "eval", "step": 1, "eval_loss": 4.0, "eval_ppl": math.exp(4.0)}
    assert read_metrics(tmp_path) == rows  # the run directory works too
    assert not (tmp_path / "tensorboard").exists()


def test_each_row_is_on_disk_when_logged(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    _train(log, 0, 5.0)
    assert len(read_metrics(tmp_path)) == 1  # flushed, before close
    log.close()
    log.close()


def test_non_finite_numbers_are_null_so_the_file_stays_json(tmp_path):
    with MetricsLog(tmp_path, tensorboard=False) as log:
        _train(log, 0, float("nan"))
        log.log_eval(0, 1000.0)  # exp overflows: inf
        log.log_eval(1, float("inf"))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(ln, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
            for ln in lines]
    assert rows[0]["loss"] is None and rows[0]["grad_norm"] == 0.5
    assert rows[1] == {"kind": "eval", "step": 0, "eval_loss": 1000.0, "eval_ppl": None}
    assert rows[2]["eval_loss"] is None and rows[2]["eval_ppl"] is None


def test_append_continues_a_resumed_run_and_a_new_run_starts_empty(tmp_path):
    with MetricsLog(tmp_path, tensorboard=False) as log:
        _train(log, 0, 5.0)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "st')  # killed mid-line
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]
    with MetricsLog(tmp_path, tensorboard=False, append=True) as log:
        _train(log, 1, 4.0)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    with MetricsLog(tmp_path, tensorboard=False) as log:
        _train(log, 7, 3.0)
    assert [r["step"] for r in read_metrics(tmp_path)] == [7]


def test_a_damaged_line_in_the_middle_is_one_config_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        read_metrics(tmp_path)


def test_tensorboard_scalars_read_back_as_logged(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import event_file_writer

    # the resumed log's file name ends in 10, the first's in 9: in the order of
    # names the resumed one came first (a CI run's order of tests did this)
    while event_file_writer._global_uid.get() < 8:
        pass
    with MetricsLog(tmp_path) as log:  # None: on, since it is installed
        _train(log, 0, 5.0)
        _train(log, 1, float("nan"))
        log.log_eval(1, 4.0)
    with MetricsLog(tmp_path, tensorboard=True, append=True) as log:  # resumed
        _train(log, 2, 3.0)
    tb = read_tensorboard(tmp_path / "tensorboard")
    assert set(tb) == {f"train/{k}" for k in TRAIN - {"step", "kind", "mfu"}} | {
        "eval/loss", "eval/ppl"}  # mfu was never measured: no scalar
    assert [s for s, _ in tb["train/loss"]] == [0, 1, 2]
    assert tb["train/loss"][0][1] == 5.0 and math.isnan(tb["train/loss"][1][1])
    assert tb["train/loss"][2][1] == 3.0
    assert tb["train/lr"] == [(s, pytest.approx(1e-3 * (s + 1))) for s in (0, 1, 2)]
    # TensorBoard keeps float32: a byte count to 7 digits
    assert tb["train/peak_bytes"][2] == (2, pytest.approx(2**30 + 2, rel=1e-7))
    assert tb["eval/loss"] == [(1, 4.0)]
    assert tb["eval/ppl"] == [(1, pytest.approx(math.exp(4.0), rel=1e-6))]


def test_tensorboard_asked_for_but_missing_is_one_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "tensorboard_available", lambda: False)
    with pytest.raises(ConfigError, match="needs tensorboard: pip install tensorboard"):
        MetricsLog(tmp_path, tensorboard=True)
    with MetricsLog(tmp_path) as log:  # None: off when missing
        assert log._writer is None


def test_importing_metrics_does_not_import_tensorboard():
    code = ("import sys, meshplan.driver.metrics; "
            "print(any('tensorboard' in m for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_a_mixture_of_experts_row_has_its_tokens_per_expert(tmp_path):
    """A step's reports (a MoE's tokens per expert, by block) go into its
    row, and into TensorBoard as one scalar per expert."""
    load = {"tokens_per_expert/blocks.0.moe": [3, 1, 0, 4]}
    with MetricsLog(tmp_path, tensorboard=tb_available()) as log:
        log.log_train(0, 5.0, grad_norm=None, lr=1e-3, tokens_per_s=1.0, mfu=None,
                      step_s=0.25, peak_bytes=1, reports=load)
        _train(log, 1, 4.0)
    rows = read_metrics(tmp_path)
    assert rows[0]["reports"] == load and "reports" not in rows[1]
    if tb_available():
        tb = read_tensorboard(tmp_path / "tensorboard")
        assert [tb[f"train/tokens_per_expert/blocks.0.moe/{e}"] for e in range(4)] == \
            [[(0, 3.0)], [(0, 1.0)], [(0, 0.0)], [(0, 4.0)]]


def tb_available() -> bool:
    return metrics.tensorboard_available()
