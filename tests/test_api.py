"""meshplan.api: the README's worked example runs as written, and the API's
argument checks say what to change."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import meshplan.api as mp
from meshplan.errors import ConfigError

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    """The first python block after the README's "Your own model" heading."""
    text = README.read_text()
    section = text[text.index("## Your own model"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_worked_example_runs(tmp_path):
    script = tmp_path / "own_model.py"
    script.write_text(readme_example())
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "plans consistent: True" in p.stdout
    diff = float(re.search(r"max \|diff\| (\S+);", p.stdout).group(1))
    assert diff <= 1e-5
    assert re.search(r"^ok True: \d+ parameter tensors", p.stdout, re.M), p.stdout
    assert len(re.findall(r"^step \d+: eager", p.stdout, re.M)) == 5
    assert (tmp_path / "step.json").is_file() and len(list((tmp_path / "plans").glob("*"))) == 5


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_plan_names_the_batch_to_capture_on():
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    graph = mp.capture(_tiny(), (x,), loss_fn=torch.nn.functional.cross_entropy, targets=(y,))
    with pytest.raises(ConfigError, match="capture on a batch of 2"):
        mp.plan(graph, mp.Mesh(1, 2), mp.Strategy(dp=2, global_batch_size=4,
                                                  micro_batch_size=1))


def test_run_checks_batches_and_the_optimizer_round_trips():
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    graph = mp.capture(_tiny(), (x,), loss_fn=torch.nn.functional.cross_entropy, targets=(y,))
    job = mp.plan(graph, mp.Mesh(1, 1), mp.Strategy(global_batch_size=4, micro_batch_size=4),
                  optimizer="adamw", lr=3e-3)
    assert mp.optimizer_of(job) == mp.OptimizerConfig.default("adamw", 3e-3)
    with pytest.raises(ConfigError, match="global batch is 4"):
        mp.run(job, _tiny(), [(torch.randn(3, 8), torch.randint(0, 3, (3,)))])
    with pytest.raises(ConfigError, match="at least one batch"):
        mp.run(job, _tiny(), [])


def test_plan_applies_the_strategys_precision_and_recompute():
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    graph = mp.capture(_tiny(), (x,), loss_fn=torch.nn.functional.cross_entropy, targets=(y,))
    s = mp.Strategy(global_batch_size=4, micro_batch_size=4, precision="bf16",
                    recompute="full", recompute_pattern=r"\d+")
    job = mp.plan(graph, mp.Mesh(1, 1), s)
    kinds = [op.kind for op in job.graph.ops]
    assert "aten._to_copy.default" in kinds
    relu = [op for op in job.graph.ops if op.kind == "aten.relu.default"]
    assert len(relu) == 2 and relu[1].phase.value == "backward"  # recomputed


@pytest.mark.slow
def test_readme_transformers_example_runs(tmp_path):
    pytest.importorskip("transformers")
    text = README.read_text()
    section = text[text.index("## A model from transformers"):]
    script = tmp_path / "hf_model.py"
    script.write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "layer_pattern auto = 'model\\.transformer\\.h\\.(\\d+)'" in p.stdout
    m = re.search(r"^ok True: max \|diff\| (\S+), 52 parameter tensors", p.stdout, re.M)
    assert m and float(m.group(1)) <= 1e-5, p.stdout
