"""Shared benchmark helpers: timing, machine facts, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    return {
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write(name: str, result: dict, table: str) -> None:
    """Write results/<name>.json and results/<name>.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(table)
    print(table)
