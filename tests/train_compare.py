"""Training from the command line judged against an eager PyTorch loop
reading the same feed (torch's AdamW, cosine schedule, clipping): every
step's loss, each evaluation and every trained parameter within 1e-5."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.cli.main import main
from meshplan.data.feed import FeedReader, Layout, TokenFeed
from meshplan.driver.metrics import read_metrics
from meshplan.driver.reference import eager_eval, eager_train
from meshplan.driver.same_masks import SameMasks
from meshplan.driver.train_model import MASKING, sized_config, written_id
from meshplan.ir.lr_schedule import LrSchedule
from meshplan.models import build_model

STEPS, GBS, MBS = 6, 8, 2
RUN = ["--steps", str(STEPS), "--global-batch-size", str(GBS), "--micro-batch-size", str(MBS),
       "--lr-schedule", "cosine", "--warmup-steps", "2", "--min-lr", "0", "--clip-grad-norm",
       "1.0", "--eval-every", "3", "--eval-batches", "2", "--vpp", "1", "--json"]


def train_and_compare(data: str, out: Path, model: list[str], layout: Layout, dp: int,
                      capsys, stray: int = 0, sizes: dict | None = None,
                      optimizer: tuple[str, float] = ("adamw", 3e-3)) -> dict:
    """Train from the command line, then eagerly from the same weights on
    the same feed, in the run's micro-batches, with `optimizer` (its kind
    and learning rate) and `sizes` (`seq_len`, `target_len`: the flags);
    returns the run's summary. Every parameter element within 1e-5 of
    eager's, but for at most `stray` of them, within 1e-4."""
    m = GBS // (MBS * dp)
    overrides = sizes or {}
    length = [x for k, v in overrides.items() if not isinstance(v, bool)
              for x in ("--" + k.replace("_", "-"), str(v))]  # a flag (--pack) is in `model`
    assert main(["-q", "train", *model, "--size", "tiny", "--data", data, "--out", str(out),
                 *length, *RUN, "--optimizer", optimizer[0], "--lr", str(optimizer[1])]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    name = model[1] if model[0] == "--model" else f"hf:{model[1]}"
    cfg = sized_config(name, "tiny", data, overrides)
    written = written_id(data, layout)
    assert cfg.vocab == 257 + (written >= 0)  # the bytes, eod and a mask or pad token
    torch.manual_seed(0)
    module = build_model(cfg)
    feed = TokenFeed(data, "train", cfg.seq_len, 0, layout,
                     mask_id=written if layout in MASKING else -1,
                     pad_id=written if layout is Layout.SOURCE_TARGET else -1,
                     target_len=cfg.target_len)
    val = FeedReader(replace(feed, split="validation", shuffle=False), GBS, m)
    reader = FeedReader(feed, GBS, m)
    opt = OptimizerConfig.of(optimizer[0], optimizer[1], max_grad_norm=1.0,
                             lr_schedule=LrSchedule("cosine", 2, None, 0.0, STEPS))
    evals = {0: eager_eval(module, [val.batch(b) for b in range(2)], m)}

    def evaluate(k: int) -> None:
        if k % 3 == 0:
            evals[k] = eager_eval(module, [val.batch(b) for b in range(2)], m)

    ref = eager_train(module, [reader.batch(k) for k in range(STEPS)], m, opt,
                      after_step=evaluate, masks=SameMasks(0))
    rows = read_metrics(out / "metrics.jsonl")
    mine = [r["loss"] for r in rows if r["kind"] == "train"]
    assert len(mine) == STEPS and max(abs(a - b) for a, b in zip(mine, ref.losses)) < 1e-5
    got = {r["step"]: r["eval_loss"] for r in rows if r["kind"] == "eval"}
    assert got.keys() == evals.keys() and max(abs(got[k] - evals[k]) for k in evals) < 1e-5
    assert ref.losses[-1] < ref.losses[0]
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    state = {k: t for k, t in module.state_dict().items() if k in weights}
    assert state
    off = sum(int((~torch.isclose(weights[k], t, atol=1e-5, rtol=1e-5)).sum())
              for k, t in state.items())
    assert off <= stray
    for key, t in state.items():
        assert torch.allclose(weights[key], t, atol=1e-4, rtol=1e-5), key
    return summary


