"""`meshplan train` against an eager PyTorch loop that reads the same token
file with the same sampler: losses, evaluations and every parameter.

The run is the user's path: `meshplan prepare-data`, then `meshplan train
--config run.toml` on 4 local rank processes (GPT tiny, dp2 pp2), 30 steps,
evaluating every 10. The reference is torch's own AdamW, cosine schedule
(`SequentialLR`) and `clip_grad_norm_` on one process (`driver/reference.py`).
"""

from __future__ import annotations

import json

import pytest
import torch

from meshplan.cli.main import main
from meshplan.data.feed import FeedReader, TokenFeed
from meshplan.driver.metrics import read_metrics, read_tensorboard
from meshplan.driver.reference import eager_eval, eager_train
from meshplan.driver.same_masks import SameMasks
from tests.token_data import stdlib_sources

RUN_TOML = """\
# GPT tiny at dp2 pp2 on 4 local ranks
[model]
model = "gpt"
size = "tiny"
dropout = 0.1

[parallel]
devices-per-node = 4
tp = 1
pp = 2
vpp = 1
global_batch_size = 8
micro_batch_size = 2

[optimizer]
optimizer = "adamw"
lr = 3e-3
lr_schedule = "cosine"
warmup_steps = 3
clip_grad_norm = 1.0
min_lr = 0.0

[run]
steps = 30
eval_every = 10
eval_batches = 2
sample_tokens = 16
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A prepared token directory and one `meshplan train --config` run on it."""
    tmp = tmp_path_factory.mktemp("train")
    data, out = tmp / "data", tmp / "run"
    assert main(["-q", "prepare-data", "--input", *stdlib_sources(5), "--out", str(data),
                 "--val-fraction", "0.3"]) == 0
    (tmp / "run.toml").write_text(RUN_TOML)
    assert main(["-q", "train", "--config", str(tmp / "run.toml"), "--data", str(data),
                 "--out", str(out), "--json"]) == 0
    return data, out


@pytest.mark.slow
def test_metrics_every_step_and_eval_every_ten(trained):
    _, out = trained
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 31))
    for r in train:
        for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_s", "peak_bytes"):
            assert r[key] is not None and r[key] >= 0, (key, r)
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 10, 20, 30]
    for name in ("config.toml", "loss.png", "model.safetensors"):
        assert (out / name).stat().st_size > 0
    events = read_tensorboard(out / "tensorboard")  # the same numbers, read back
    assert [k for k, _ in events["train/loss"]] == list(range(1, 31))
    assert [v for _, v in events["train/loss"]] == pytest.approx([r["loss"] for r in train])
    assert [k for k, _ in events["eval/loss"]] == [0, 10, 20, 30]


@pytest.mark.slow
def test_losses_evals_and_weights_equal_an_eager_loop(trained):
    """fp32: every step's loss, every evaluation and every trained parameter
    within 1e-5 of eager PyTorch reading the same file with the same sampler,
    its dropout drawing the run's masks (seed 0, the data's) and off in
    evaluation (`module.eval()`; the ranks' forward-only plan has none)."""
    from safetensors.torch import load_file

    from meshplan.autodiff import OptimizerConfig
    from meshplan.ir.lr_schedule import LrSchedule
    from meshplan.models import build_model, model_config

    data, out = trained
    cfg = model_config("gpt", "tiny", vocab=257, dropout=0.1)
    torch.manual_seed(0)
    module = build_model(cfg)
    feed = TokenFeed(str(data), "train", cfg.seq_len, 0)
    val = FeedReader(TokenFeed(str(data), "validation", cfg.seq_len, 0, shuffle=False), 8, 4)
    reader = FeedReader(feed, 8, 4)
    opt = OptimizerConfig.of("adamw", 3e-3, max_grad_norm=1.0,
                             lr_schedule=LrSchedule("cosine", 3, None, 0.0, 30))
    evals = {0: eager_eval(module, [val.batch(b) for b in range(2)], 4)}

    def evaluate(k: int) -> None:
        if k % 10 == 0:
            evals[k] = eager_eval(module, [val.batch(b) for b in range(2)], 4)

    ref = eager_train(module, [reader.batch(k) for k in range(30)], 4, opt, after_step=evaluate,
                      masks=SameMasks(0))
    rows = read_metrics(out / "metrics.jsonl")
    mine = [r["loss"] for r in rows if r["kind"] == "train"]
    assert max(abs(a - b) for a, b in zip(mine, ref.losses)) < 1e-5
    got = {r["step"]: r["eval_loss"] for r in rows if r["kind"] == "eval"}
    assert got.keys() == evals.keys()
    assert max(abs(got[k] - evals[k]) for k in evals) < 1e-5
    assert ref.losses[-1] < 0.8 * ref.losses[0]  # it learned: the comparison means something
    weights = load_file(str(out / "model.safetensors"))
    eager = module.state_dict()
    assert weights.keys() == eager.keys()
    for name, t in weights.items():
        assert torch.allclose(t, eager[name], atol=1e-5, rtol=1e-5), name


def test_each_rank_reads_only_its_rows(tmp_path):
    """dp2 pp2: the input stage's ranks and the label stage's ranks read
    micro_batch_size x num_microbatches samples a step each; the others (none
    at pp2) read nothing. At pp3 the middle stage reads nothing."""
    import meshplan.api as mp
    from meshplan.driver.plan import plan_model, zoo_strategy
    from meshplan.models import build_model, model_config

    data = tmp_path / "data"
    assert main(["-q", "prepare-data", "--input", *stdlib_sources(2), "--out", str(data)]) == 0
    cfg = model_config("gpt", "tiny", vocab=257, layers=3)
    s = zoo_strategy("gpt", cfg, dp=2, pp=3, global_batch_size=12, micro_batch_size=2)
    job = plan_model("gpt", "tiny", mp.Mesh(1, 6), s, "sgd", vocab=257, layers=3).job
    torch.manual_seed(0)
    steps = 2
    r = mp.train(job, build_model(cfg), TokenFeed(str(data), "train", cfg.seq_len, 0),
                 steps=steps, out=str(tmp_path / "run"), tensorboard=False)
    per_step = s.micro_batch_size * job.strategy.num_microbatches
    stage = {rank: job.strategy.stage_of_rank(rank) for rank in range(6)}
    for rank, n in r.rows_read.items():
        if stage[int(rank)] == 1:
            assert n is None  # no reader at all: its plan reads no data
        else:
            assert n == steps * per_step, (rank, n)
    assert json.loads(json.dumps(r.rows_read))  # reported as plain JSON


MODULE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class TinyLM(nn.Module):
    def __init__(self, vocab_size, width=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, inputs, targets):
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def build(vocab_size):
    return TinyLM(vocab_size)
'''


@pytest.mark.slow
def test_a_users_module_trains_from_the_command_line(trained, tmp_path, monkeypatch):
    """`--module PKG.MODULE:FACTORY`: the user's own module, at pp2, equal to
    eager on the same token file."""
    from safetensors.torch import load_file

    from meshplan.autodiff import OptimizerConfig

    data, _ = trained
    (tmp_path / "my_lm.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert main(["-q", "train", "--module", "my_lm:build", "--data", str(data), "--out",
                 str(out), "--devices-per-node", "2", "--tp", "1", "--pp", "2", "--vpp", "1",
                 "--seq-len", "32", "--steps", "4", "--eval-every", "2", "--eval-batches", "1",
                 "--optimizer", "sgd", "--lr", "0.1", "--lr-schedule", "constant",
                 "--warmup-steps", "0", "--clip-grad-norm", "1.0", "--json"]) == 0
    import my_lm

    torch.manual_seed(0)
    module = my_lm.build(257)
    reader = FeedReader(TokenFeed(str(data), "train", 32, 0), 16, 4)
    ref = eager_train(module, [reader.batch(k) for k in range(4)], 4,
                      OptimizerConfig.of("sgd", 0.1, max_grad_norm=1.0))
    rows = read_metrics(out / "metrics.jsonl")
    mine = [r["loss"] for r in rows if r["kind"] == "train"]
    assert max(abs(a - b) for a, b in zip(mine, ref.losses)) < 1e-5
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 2, 4]
    assert all(len(r["peak_bytes_per_stage"]) == 2 for r in rows if r["kind"] == "train")
    weights = load_file(str(out / "model.safetensors"))
    for name, t in module.state_dict().items():
        assert torch.allclose(weights[name], t, atol=1e-5, rtol=1e-5), name


@pytest.mark.parametrize("tokens, gbs, seq_len, steps", [
    (1, 8, 16, 1), (128, 8, 16, 1), (129, 8, 16, 2), (10_000, 16, 128, 5), (4096, 16, 128, 2)])
def test_tokens_as_steps_cover_them(tokens, gbs, seq_len, steps):
    from meshplan.driver.train import tokens_to_steps

    assert tokens_to_steps(tokens, gbs, seq_len) == steps
    assert steps * gbs * seq_len >= tokens > (steps - 1) * gbs * seq_len or steps == 1


@pytest.mark.slow
def test_a_parameter_the_loss_never_reads_keeps_its_start(tmp_path, monkeypatch):
    """A weight no op of the step reads (a pooler, another modality's tower)
    is held by no rank; the run's weights keep it as it started, as eager's
    optimizer, which skips a parameter without a gradient, does."""
    from safetensors.torch import load_file

    from tests.token_data import prepare, stdlib_sources

    data = prepare(tmp_path / "data", stdlib_sources(3), "--val-fraction", "0.4")
    (tmp_path / "pooled_lm.py").write_text(MODULE + '''

class Pooled(TinyLM):
    def __init__(self, vocab_size):
        super().__init__(vocab_size)
        self.pooler = nn.Linear(32, 32)  # never called by forward


def build_pooled(vocab_size):
    return Pooled(vocab_size)
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert main(["-q", "train", "--module", "pooled_lm:build_pooled", "--data", data, "--out",
                 str(out), "--devices-per-node", "2", "--dp", "2", "--tp", "1", "--pp", "1",
                 "--seq-len", "32", "--steps", "2", "--eval-every", "0", "--optimizer",
                 "adamw", "--lr", "0.01", "--lr-schedule", "constant", "--warmup-steps", "0",
                 "--json"]) == 0
    import pooled_lm

    torch.manual_seed(0)
    start = pooled_lm.build_pooled(257)
    weights = load_file(str(out / "model.safetensors"))
    assert torch.equal(weights["pooler.weight"], start.pooler.weight.detach())
    assert not torch.equal(weights["head.weight"], start.head.weight.detach())  # trained
