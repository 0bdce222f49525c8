"""The heartbeat: a rank that stops making progress ends the run within the
stall timeout, named; a run longer than the stall timeout whose ranks keep
going completes (there is no overall time limit).

A rank is stalled for real: its process is stopped with SIGSTOP (as a hung
host would be), from the launcher's own per-step callback.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

import meshplan.api as mp
from meshplan.errors import RuntimeFault
from meshplan.models import build_model, example_batch, model_config

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")


def _job():
    from meshplan.driver.plan import plan_model, zoo_strategy

    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, dp=1, pp=2, global_batch_size=4, micro_batch_size=2)
    torch.manual_seed(0)
    return plan_model("gpt", "tiny", mp.Mesh(1, 2), s, "sgd").job, build_model(cfg), cfg


def _rank_pid(rank: int) -> int:
    return next(p.pid for p in multiprocessing.active_children()
                if p.name == f"meshplan-rank-{rank}")


def test_a_stalled_rank_ends_the_run_within_the_stall_timeout(tmp_path):
    job, module, cfg = _job()
    batches = [example_batch(cfg, 4, seed=k) for k in range(50)]
    stopped = {}

    def stall_rank_1(k: int) -> None:
        if not stopped:  # at the first report (k >= 1: reports may skip steps)
            stopped["at"] = time.monotonic()
            os.kill(_rank_pid(1), signal.SIGSTOP)

    with pytest.raises(RuntimeFault, match=r"rank 1 made no progress for \d+ s "
                                           r"\(--stall-timeout 3; its process is frozen\)"):
        mp.train(job, module, batches, out=str(tmp_path), stall_s=3.0, on_step=stall_rank_1,
                 tensorboard=False)
    assert stopped, "the run ended before the rank was stopped"
    assert time.monotonic() - stopped["at"] < 3.0 + 5.0  # within the timeout and a poll
    assert not multiprocessing.active_children()  # every rank ended


def test_a_run_longer_than_the_stall_timeout_completes(tmp_path):
    """Rank 1 is paused three times for 1.2 s: the run takes well over its
    2.5 s stall timeout, yet no rank is ever 2.5 s without progress."""
    job, module, cfg = _job()
    batches = [example_batch(cfg, 4, seed=k) for k in range(40)]
    pauses = []

    def pause_rank_1(k: int) -> None:
        if len(pauses) == 3 or k >= 35:  # enough, or the ranks are ending
            return
        pid = _rank_pid(1)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(1.2)
        os.kill(pid, signal.SIGCONT)
        pauses.append(k)

    t0 = time.monotonic()
    r = mp.train(job, module, batches, out=str(tmp_path), stall_s=2.5, on_step=pause_rank_1,
                 tensorboard=False)
    assert len(r.losses) == 40 and len(pauses) == 3
    assert time.monotonic() - t0 > 3.6
