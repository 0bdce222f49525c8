"""Layout-invariant randomness (issue 36): a dropout's logical mask, gathered
from the ranks' pieces, is bit for bit the same at every layout; the run
equals eager PyTorch drawing the same masks; masks of other micro-batches,
steps and dp ranks differ, and keep 1 - p of the elements.

Every rank runs on a thread (`runtime/local.py`), so the recording kernel
patched into `runtime/bind.py` sees every rank's draws."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import against_eager
from meshplan.ir.kinds import DROPOUT
from meshplan.ir.mesh import Mesh
from meshplan.models import build_model, example_batch, model_config
from meshplan.ops import counter_rng, random_ops
from meshplan.runtime import bind
from meshplan.runtime.local import run_local

P = 0.1
STEPS, M, BATCH = 2, 4, 8  # every layout: 4 micro-batches of 2 samples
LAYOUTS = {
    "1 rank": (dict(micro_batch_size=2), 1),
    "dp2": (dict(dp=2, micro_batch_size=1), 2),
    "tp2": (dict(tp=2, micro_batch_size=2), 2),
    "dp2 tp2 pp2 vpp2": (dict(dp=2, tp=2, pp=2, vpp=2, micro_batch_size=1), 8),
    "zbv": (dict(pp=2, vpp=2, schedule="zbv", micro_batch_size=2), 2),
    "recompute full": (dict(recompute="full", micro_batch_size=2), 1),
}


def _labels(shape, ops: int = 64) -> dict:
    """The stream of a draw of `shape` -> its (step, micro-batch, op key), seed 0."""
    return {counter_rng.RandomCounter(0, s, m).stream(k, shape): (s, m, k)
            for s in range(STEPS) for m in range(M) for k in range(ops)}


def _masks(monkeypatch, layout: str, shift: bool = False) -> tuple[dict, bool]:
    """Every dropout's logical mask of a GPT tiny run at `layout`, by
    (step, micro-batch, op key), gathered from the ranks' boxes (replicas
    and a recompute's second draw checked equal to the first), and whether
    the run equals eager. `shift` plants a bug: each rank draws its piece as
    if it began at the logical tensor's origin."""
    fields, world = LAYOUTS[layout]
    cfg = model_config("gpt", "tiny", dropout=P)
    s = zoo_strategy("gpt", cfg, global_batch_size=BATCH, **fields)
    job = plan_model("gpt", "tiny", Mesh(1, world), s, dropout=P).job
    lock, pieces = threading.Lock(), {}

    def recording(x, p, key, *, draw):
        box = draw["box"]
        if shift:
            draw = dict(draw, box=tuple((0, b - a) for a, b in box))
        out, mask = random_ops.dropout_kernel(x, p, key, draw=draw)
        with lock:
            seen = pieces.setdefault(_labels(draw["shape"])[draw["stream"]],
                                     (draw["shape"], {}))[1]
            old = seen.setdefault(box, mask.clone())
            assert torch.equal(old, mask), "a box drawn twice differs (a replica, a recompute)"
        return out, mask

    monkeypatch.setitem(bind.RANDOM_KERNELS, DROPOUT, recording)
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, BATCH, seed=i) for i in range(STEPS)]
    mine = run_local(job, module, batches)
    verdict, _ = against_eager(mine.rank_losses, mine.slices, module, batches, M,
                               OptimizerConfig.of_job(job))
    return {k: _assemble(shape, boxes) for k, (shape, boxes) in pieces.items()}, verdict["ok"]


def _assemble(shape, boxes: dict) -> torch.Tensor:
    whole = torch.zeros(shape, dtype=torch.int8) - 1
    for box, mask in boxes.items():
        whole[tuple(slice(a, b) for a, b in box)] = mask.to(torch.int8)
    assert (whole >= 0).all(), "the ranks' boxes do not cover the logical tensor"
    return whole.bool()


@pytest.fixture(scope="module")
def one_rank():
    mp = pytest.MonkeyPatch()
    try:
        yield _masks(mp, "1 rank")
    finally:
        mp.undo()


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "1 rank"])
def test_masks_are_the_same_at_every_layout(one_rank, monkeypatch, layout):
    reference, ok = one_rank
    assert ok
    masks, ok = _masks(monkeypatch, layout)
    assert ok, f"{layout}: not equal to eager drawing the same masks"
    assert masks.keys() == reference.keys()
    for key, mask in reference.items():
        assert torch.equal(masks[key], mask), f"{layout}: mask {key} differs"


def test_a_rank_drawing_the_wrong_piece_is_caught(one_rank, monkeypatch):
    """The planted bug: every rank draws from the origin. Its masks differ
    from one rank's, and eager (drawing whole masks) disagrees."""
    reference, _ = one_rank
    masks, ok = _masks(monkeypatch, "dp2", shift=True)
    assert not ok
    assert any(not torch.equal(masks[k], m) for k, m in reference.items())


def test_masks_differ_and_keep_one_minus_p(one_rank):
    masks, _ = one_rank
    ops = sorted({k for _, _, k in masks})
    assert len(ops) == 3 * model_config("gpt", "tiny").layers + 1  # 3 a block, 1 embedding
    first = masks[(0, 0, ops[0])]
    for other in [(0, 1, ops[0]), (1, 0, ops[0])]:  # another micro-batch, another step
        assert not torch.equal(masks[other], first)
    assert not torch.equal(first[0], first[1])  # the samples dp would split apart
    kept = torch.cat([m.flatten() for m in masks.values()]).double()
    n = kept.numel()
    se = math.sqrt(P * (1 - P) / n)
    assert abs(kept.mean().item() - (1 - P)) < 3 * se, (kept.mean().item(), se)
