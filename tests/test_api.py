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
    assert (tmp_path / "step.json").is_file()
    assert len(list((tmp_path / "plans").glob("rank_*.plan"))) == 4  # and job.json, classes/
    assert len(list((tmp_path / "plans" / "classes").glob("*.plan"))) == 2  # one per stage


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
    assert mp.OptimizerConfig.of_job(job) == mp.OptimizerConfig.default("adamw", 3e-3)
    with pytest.raises(ConfigError, match="global batch is 4"):
        mp.run(job, _tiny(), [(torch.randn(3, 8), torch.randint(0, 3, (3,)))])
    with pytest.raises(ConfigError, match="at least one batch"):
        mp.run(job, _tiny(), [])


def test_plan_applies_the_strategys_precision_and_recompute():
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    graph = mp.capture(_tiny(), (x,), loss_fn=torch.nn.functional.cross_entropy, targets=(y,),
                       precision="bf16")
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
    assert "layer_pattern derived = 'model\\.transformer\\.h\\.(\\d+)'" in p.stdout
    m = re.search(r"^ok True: max \|diff\| (\S+), 52 parameter tensors", p.stdout, re.M)
    assert m and float(m.group(1)) <= 1e-5, p.stdout


def _gpt_tiny_graph(batch: int, device: str = "cpu"):
    from meshplan.models import build_model, example_batch, model_config

    cfg = model_config("gpt", "tiny")
    torch.manual_seed(0)
    module = build_model(cfg, device=device)
    data = example_batch(cfg, batch, device=device)
    return module, data, mp.capture(module, data)


def test_auto_on_a_graph_prices_as_the_rebuilt_model():
    """A captured graph's probes (the whole graph as 1, L - 2, 1 layers, at the
    dp its batch needs) price every candidate as the model rebuilt with three
    layers does; tp is kept out (4 nodes of 1 device), since the graph's tp
    plan is its own."""
    from meshplan.costmodel import load_device_model
    from meshplan.search.probe import GraphSpec, ModelSpec
    from meshplan.search.search import search
    from meshplan.search.space import Space

    _, _, graph = _gpt_tiny_graph(4, "meta")
    base = mp.Strategy(layer_pattern=r"blocks\.(\d+)", global_batch_size=16)
    spec = GraphSpec(graph, base, mp.OptimizerConfig.default("adamw"), 4, 4, "gpt tiny")
    dev, mesh = load_device_model("a100-80gb"), mp.Mesh(4, 1)
    got = search(spec, mesh, 16, dev, prove=False, top=50).ranked
    want = search(ModelSpec("gpt", "tiny"), mesh, 16, dev, space=Space(samples=4),
                  prove=False, top=50).ranked
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        assert a.cand == b.cand and a.pred.peak == b.pred.peak
        assert a.pred.step_s == pytest.approx(b.pred.step_s, rel=1e-9)
        assert a.cand.dp * a.cand.micro_batch_size == 4


@pytest.mark.slow
def test_plan_auto_on_a_captured_graph_trains_like_eager():
    module, data, graph = _gpt_tiny_graph(4)
    job = mp.plan(graph, mp.Mesh(1, 4), mp.Strategy(auto=True, global_batch_size=8),
                  optimizer="adamw", device_model="a100-80gb")
    s = job.strategy
    assert not s.auto and s.dp * s.micro_batch_size == 4 and s.dp * s.tp * s.pp == 4
    from meshplan.models import example_batch, model_config

    batches = [example_batch(model_config("gpt", "tiny"), 8, seed=k) for k in range(2)]
    res = mp.verify(job, module, batches)
    assert res.ok, res.problems


def test_auto_needs_layers_to_price():
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    graph = mp.capture(_tiny(), (x,), loss_fn=torch.nn.functional.cross_entropy, targets=(y,))
    with pytest.raises(ConfigError, match="at least 3 layers"):
        mp.plan(graph, mp.Mesh(1, 2), mp.Strategy(auto=True, global_batch_size=8))
    with pytest.raises(ConfigError, match="resolved by meshplan.api.plan"):
        from meshplan.passes.strategy import check_strategy

        check_strategy(mp.Mesh(1, 1), mp.Strategy(auto=True))
