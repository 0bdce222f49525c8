"""Where a training run's numbers go: `OUT/metrics.jsonl`, and TensorBoard.

Invariants:
- `OUT/metrics.jsonl` is always written: one JSON object per line, each
  line flushed as it is logged, so a crash loses at most the line being
  written. A row is `{"kind": "train", step, loss, grad_norm, lr,
  tokens_per_s, mfu, step_s, peak_bytes}` (with `peak_bytes_per_stage`,
  and from token data `data_sha256`: the sha256 of the sorted ids of the
  samples the step read, equal at any layout for the same samples; and a
  mixture of experts' `reports`, `{"tokens_per_expert/<block>": [count per
  expert]}`) or
  `{"kind": "eval", step, eval_loss, eval_ppl}`.
- The file is strict JSON (any JSON reader takes it): a number that is not
  finite (a NaN loss, an overflowed perplexity) and a value not measured
  are written as `null`.
- A resumed run (`append=True`) adds to the file; otherwise it starts empty.
  A line a killed run left half-written is cut before appending, and
  `read_metrics` skips a torn last line (any other bad line is an error).
- A resume (by `--resume`, or a restart after a failure) writes `{"kind":
  "resume", "step": k, "checkpoint": DIR, "reason": TEXT}`: the rows after
  step k written before it are the failed attempt's, and `read_metrics`
  drops them, so it gives the run's history as it was continued.
- With TensorBoard (`tensorboard=None`: when the package is installed), the
  same numbers go to `OUT/tensorboard/` as scalars `train/<key>` and
  `eval/loss`, `eval/ppl` at their step (a value not measured is skipped).
  `torch.utils.tensorboard` is imported only then: importing this module
  never needs tensorboard.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from meshplan.errors import ConfigError
from meshplan.ir.fileio import LineLog

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
TRAIN_KEYS = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_s", "peak_bytes")


class MetricsLog:
    """The numbers of one training run, written as they come (see the module
    docstring); a context manager that closes its files."""

    def __init__(self, out_dir: str | Path, tensorboard: bool | None = None,
                 append: bool = False):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard is None:
            tensorboard = tensorboard_available()
        elif tensorboard and not tensorboard_available():
            raise ConfigError("TensorBoard logging needs tensorboard: pip install tensorboard "
                              "(or log to metrics.jsonl only)")
        self.path = self.out_dir / METRICS_FILE
        self._file = LineLog(self.path, append)
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional

            self._writer = SummaryWriter(log_dir=str(self.out_dir / TENSORBOARD_DIR),
                                         flush_secs=10)

    def log_train(self, step: int, loss, grad_norm, lr, tokens_per_s, mfu, step_s,
                  peak_bytes, peak_bytes_per_stage: list | None = None,
                  data_sha256: str | None = None, reports: dict | None = None) -> None:
        """One training step's row (None: not measured); with
        `peak_bytes_per_stage`, each pipeline stage's measured peak too; with
        `data_sha256`, the fingerprint of the samples it read; with `reports`,
        the graph's reports (a mixture of experts' tokens per expert)."""
        values = dict(zip(TRAIN_KEYS, (loss, grad_norm, lr, tokens_per_s, mfu, step_s,
                                       peak_bytes), strict=True))
        stages = {} if peak_bytes_per_stage is None else \
            {"peak_bytes_per_stage": [int(x) for x in peak_bytes_per_stage]}
        data = {} if data_sha256 is None else {"data_sha256": data_sha256}
        self._write({"kind": "train", "step": int(step)} | values | stages | data
                    | ({"reports": reports} if reports else {}))
        self._scalars("train", step, values | {f"peak_bytes_stage{i}": x for i, x in
                                               enumerate(peak_bytes_per_stage or ())}
                      | {f"{name}/{i}": x for name, xs in (reports or {}).items()
                         for i, x in enumerate(xs)})

    def log_eval(self, step: int, eval_loss) -> None:
        """One evaluation's row: its loss and perplexity exp(loss) (inf when
        that overflows; null in the file)."""
        loss = None if eval_loss is None else float(eval_loss)
        ppl = None if loss is None else perplexity(loss)
        self._write({"kind": "eval", "step": int(step), "eval_loss": loss, "eval_ppl": ppl})
        self._scalars("eval", step, {"loss": loss, "ppl": ppl})

    def log_resume(self, step: int, checkpoint: str, reason: str) -> None:
        """The run continues from `checkpoint`, after `step` steps."""
        self._write({"kind": "resume", "step": int(step), "checkpoint": str(checkpoint),
                     "reason": reason})

    def _write(self, row: dict) -> None:
        row = {k: _json_number(v) for k, v in row.items()}
        self._file.write(json.dumps(row, allow_nan=False))

    def _scalars(self, group: str, step: int, values: dict) -> None:
        if self._writer is None:
            return
        for key, value in values.items():
            if value is not None:
                self._writer.add_scalar(f"{group}/{key}", float(value), int(step))

    def close(self) -> None:
        """Flush and close the files (again: nothing)."""
        if not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tensorboard_available() -> bool:
    """Whether the tensorboard package is installed (not imported here)."""
    return importlib.util.find_spec("tensorboard") is not None


def perplexity(loss: float) -> float:
    """exp(loss), inf where it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def _json_number(value):
    """`value` as JSON takes it: ints and strings as they are, other numbers
    (tensors too) as float, a non-finite one as None."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, list):
        return [_json_number(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_number(v) for k, v in value.items()}
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a `metrics.jsonl` (a file or the run directory holding
    it), in the order written, less those a resume superseded (the module
    docstring); a torn last line is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a run killed mid-write
                break
            raise ConfigError(f"{path} line {i + 1} is not JSON; it was edited or damaged: "
                              "delete that line") from None
        if rows[-1].get("kind") == "resume":
            k = rows[-1]["step"]
            rows[:-1] = [r for r in rows[:-1] if r["step"] <= k]
    return rows


def read_tensorboard(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under `log_dir` (a run's
    `OUT/tensorboard`): tag -> [(step, value)] in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )  # optional

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    # by the time written: the files come in the order of their names, which end
    # in a counter of the writing process ("...9" after "...10")
    return {tag: [(e.step, e.value) for e in sorted(acc.Scalars(tag), key=lambda e: e.wall_time)]
            for tag in acc.Tags()["scalars"]}
