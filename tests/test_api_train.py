"""`mp.train` gives the trained weights back, equal to an eager PyTorch loop
(torch's own optimizer, clipping and schedule): the README's classifier on
batches held in memory, and a transformers causal LM on a token file read
rank by rank."""

from __future__ import annotations

import copy
import re
import sysconfig
from pathlib import Path

import pytest
import torch

import meshplan.api as mp
from meshplan.cli.main import main
from meshplan.data.feed import FeedReader, Layout, TokenFeed
from meshplan.driver.reference import eager_train

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_classifier():
    """The README's `Classifier`, from its own text (the classes only)."""
    text = README.read_text()
    section = text[text.index("## Your own model"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(code.split('if __name__ == "__main__":')[0], scope)  # noqa: S102 - our own README
    return scope["Classifier"]


def _equal_weights(got: dict, module: torch.nn.Module, atol: float = 1e-5) -> None:
    want = dict(module.named_parameters())
    assert want.keys() <= got.keys()
    for name, t in want.items():
        assert torch.allclose(got[name], t.detach(), atol=atol, rtol=1e-5), name


def test_readme_classifier_trains_as_eager(tmp_path):
    torch.manual_seed(0)
    model = readme_classifier()()
    eager = copy.deepcopy(model)
    strategy = mp.Strategy(dp=2, pp=2, global_batch_size=16, micro_batch_size=2,
                           layer_pattern=r"blocks\.(\d+)")
    batches = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(5)]
    x, y = batches[0]
    job = mp.plan(mp.capture(model, (x[:4], y[:4])), mp.Mesh(1, 4), strategy,
                  optimizer=mp.OptimizerConfig.of("adamw", 1e-3, max_grad_norm=1.0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = mp.train(job, model, batches, out=str(tmp_path), load=False, tensorboard=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # load=False
    ref = eager_train(eager, batches, job.strategy.num_microbatches, mp.OptimizerConfig.of_job(job))
    assert max(abs(a - b) for a, b in zip(r.losses, ref.losses)) < 1e-5
    _equal_weights(r.weights, eager)
    mp.train(job, model, batches, out=str(tmp_path / "again"), tensorboard=False)
    _equal_weights(dict(model.named_parameters()), eager)  # load=True: the module holds them


@pytest.mark.slow
def test_transformers_llm_trains_as_eager_on_a_token_file(tmp_path):
    from meshplan.models import build_model, model_config

    data = tmp_path / "data"
    src = Path(sysconfig.get_paths()["stdlib"]) / "json"
    assert main(["-q", "prepare-data", "--input", str(src / "*.py"), "--out", str(data)]) == 0
    cfg = model_config("hf:llama", "tiny", vocab=257)
    torch.manual_seed(0)
    model = build_model(cfg)
    eager = copy.deepcopy(model)
    feed = TokenFeed(str(data), "train", cfg.seq_len, 3, Layout.SHIFTED_BY_MODEL)
    strategy = mp.Strategy(dp=2, pp=2, global_batch_size=8, micro_batch_size=2,
                           layer_pattern="derived")
    reader = FeedReader(feed, 8, 2)
    x, y = reader.batch(0)
    job = mp.plan(mp.capture(model, (x[:4], y[:4])), mp.Mesh(1, 4), strategy,
                  optimizer=mp.OptimizerConfig.of("adamw", 3e-3, max_grad_norm=1.0))
    r = mp.train(job, model, feed, steps=4, out=str(tmp_path / "run"), tensorboard=False)
    ref = eager_train(eager, [reader.batch(k) for k in range(4)], 2, mp.OptimizerConfig.of_job(job))
    assert max(abs(a - b) for a, b in zip(r.losses, ref.losses)) < 1e-5
    _equal_weights(r.weights, eager)
    _equal_weights(dict(model.named_parameters()), eager)
