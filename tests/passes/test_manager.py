"""The pass manager: the list's order is checked when it is built, and with
checks on the IR invariant check runs after every pass, naming the one that broke
the graph."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from meshplan.capture import capture
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.passes.manager import Pass, PassManager, PassOrderError
from meshplan.passes.plan import PASSES, Compilation


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.sum()


@pytest.fixture(scope="module")
def forward():
    return capture(Mlp(), (torch.randn(4, 4),))


def _state(forward, **fields):
    s = Strategy(global_batch_size=8, micro_batch_size=2, layer_pattern=r"blocks\.\d+", **fields)
    return Compilation(forward, Mesh(1, s.dp * s.pp), s)


def test_a_misordered_list_is_refused_when_built():
    names = list(PASSES.names)
    i, j = names.index("apply_precision"), names.index("autodiff")
    swapped = list(PASSES.passes)
    swapped[i], swapped[j] = swapped[j], swapped[i]  # autodiff before the casts it needs
    with pytest.raises(PassOrderError, match=r"'autodiff' requires 'casts' \(ensured by "
                                             r"'apply_precision'\)"):
        PassManager(swapped, PASSES.check)


def test_a_requirement_no_pass_ensures_and_a_repeated_name_are_refused():
    lonely = Pass("lonely", lambda c: None, frozenset({"magic"}))
    with pytest.raises(PassOrderError, match="'magic' \\(ensured by no pass\\)"):
        PassManager([*PASSES.passes, lonely], PASSES.check)
    with pytest.raises(PassOrderError, match="'make_job' is listed twice"):
        PassManager([*PASSES.passes, PASSES.passes[-1]], PASSES.check)


def test_with_checks_the_verifier_runs_after_every_pass_that_ran(forward):
    ran: list[str] = []
    timings: dict = {}

    def check(c):
        PASSES.check(c)
        ran.append(list(timings)[-1])  # the pass that just ran

    manager = PassManager(PASSES.passes, check)
    in_bf16 = capture(Mlp(), (torch.randn(4, 4),), precision="bf16")
    c = manager.run(_state(in_bf16, dp=2, pp=2, precision="bf16", recompute="full",
                           schedule="zb1p"), checks=True, timings=timings)
    assert c.job is not None
    assert ran == list(timings) == [p for p in PASSES.names
                                    if p not in ("expand_log_softmax", "expert_load",
                                                 "expert_parallel", "context_parallel",
                                                 "balance_sequence")]
    ran.clear()
    timings.clear()
    manager.run(_state(forward), checks=False, timings=timings)
    assert not ran and "make_job" in timings


def _drop_an_op(c):
    """A planted bug: the graph loses an op whose output later ops read."""
    g = c.graph
    c.graph = replace(g, ops=g.ops[:3] + g.ops[4:])


@pytest.mark.parametrize("after", ["autodiff", "propagate_sbp", "recompute"])
def test_with_checks_a_pass_that_breaks_the_graph_is_named_right_after_it(forward, after):
    passes = list(PASSES.passes)
    at = PASSES.names.index(after) + 1
    bad = Pass("drop_an_op", _drop_an_op, when=passes[at - 1].when)
    manager = PassManager(passes[:at] + [bad] + passes[at:], PASSES.check)
    timings: dict = {}
    with pytest.raises(AssertionError, match="after pass 'drop_an_op': "):
        manager.run(_state(forward, recompute="full"), checks=True, timings=timings)
    assert list(timings)[-1] == "drop_an_op"  # caught before the next pass ran


def test_the_cli_debug_flag_turns_the_checks_on(monkeypatch, capsys):
    """`meshplan --debug ...` runs the invariant check after every pass (the
    manager reads MESHPLAN_CHECKS, which the ranks it starts inherit too)."""
    from meshplan.cli.main import main

    seen = []
    real = PassManager.run

    def spy(self, state, *a, checks=None, **k):
        import os
        seen.append(checks if checks is not None else os.environ.get("MESHPLAN_CHECKS") == "1")
        return real(self, state, *a, checks=checks, **k)

    monkeypatch.setenv("MESHPLAN_CHECKS", "0")
    monkeypatch.setattr(PassManager, "run", spy)
    assert main(["plan", "--model", "gpt", "--size", "tiny", "--devices-per-node", "1"]) == 0
    assert main(["--debug", "plan", "--model", "gpt", "--size", "tiny",
                 "--devices-per-node", "1"]) == 0
    capsys.readouterr()
    assert seen == [False, True]
    import os
    assert os.environ["MESHPLAN_CHECKS"] == "0"  # as it was: in-process callers keep theirs
