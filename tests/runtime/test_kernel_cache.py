"""`runtime/kernel_cache.py`: each Inductor run is built once per machine by
AOTInductor and loaded by every rank without Inductor. The cache's logic
(one build per key under a lock, refusals remembered, keys) is tested with a
planted builder; one slow test builds for real and checks what a warm rank
pays (no Inductor, no dynamo) and what a built run keeps of eager kernels'
semantics (strides, in-place state, the accumulators' protocol); another
has a helper process (`builds.py`) build a rank's noted runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch

from meshplan.ir import Op, Ref
from meshplan.ir import kinds as k
from meshplan.ir.fileio import file_lock
from meshplan.ops import function_op, kernels
from meshplan.runtime import builds, fused, kernel_cache

CPU = torch.device("cpu")


def _relu_graph():
    return torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))


def test_keys_follow_what_the_code_depends_on():
    gm, x = _relu_graph(), torch.ones(4, 8)
    key = kernel_cache.artifact_key(gm, [x], CPU)
    assert key == kernel_cache.artifact_key(gm, [torch.zeros(4, 8)], CPU)  # values: no
    assert key != kernel_cache.artifact_key(gm, [torch.ones(2, 8)], CPU)  # shapes
    assert key != kernel_cache.artifact_key(gm, [torch.ones(8, 4).t()], CPU)  # strides
    assert key != kernel_cache.artifact_key(gm, [x.double()], CPU)  # dtypes
    assert key != kernel_cache.artifact_key(gm, [torch.ones(33)[1:].view(4, 8)], CPU)  # alignment
    assert key != kernel_cache.artifact_key(gm, [kernels.own(torch.ones(4, 8))], CPU)  # marks
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # a CPU kernel is built for a thread count
    try:
        assert key != kernel_cache.artifact_key(gm, [x], CPU)
    finally:
        torch.set_num_threads(threads)


class _Planted:
    """A builder that writes a stub package slowly, counting its builds, and
    a loader that runs the graph itself."""

    def __init__(self, monkeypatch, fail: str = ""):
        self.built: list[str] = []
        self.by: list[str] = []  # the thread of each build
        self.graphs: dict[str, torch.fx.GraphModule] = {}
        self.fail = fail
        monkeypatch.setattr(kernel_cache, "build", self.build)
        monkeypatch.setattr(builds, "helper_count", lambda *_: 0)  # they would build for real
        monkeypatch.setattr(kernel_cache, "load", lambda lib, device: self.graphs[lib.name])

    def build(self, gm, args, lib):
        self.built.append(lib.name)
        self.by.append(threading.current_thread().name)
        self.gm = self.graphs[lib.name] = gm
        time.sleep(0.3)
        if self.fail:
            raise RuntimeError(self.fail)
        lib.touch()


def test_equal_runs_build_once_per_machine(monkeypatch, tmp_path):
    """Processes (here threads) of a machine needing the same run: one builds,
    the others wait and load it; a run with other shapes builds beside them."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    planted = _Planted(monkeypatch)
    gm = _relu_graph()
    outs: list = []

    def rank(x):
        outs.append(kernel_cache.ahead_of_time(gm, [x], CPU)(x))

    threads = [threading.Thread(target=rank, args=(torch.ones(4, 8) * i,)) for i in range(6)]
    threads.append(threading.Thread(target=rank, args=(torch.ones(2, 8),)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(outs) == 7
    assert len(planted.built) == 2 and len(set(planted.built)) == 2, planted.built


def test_a_run_another_process_is_building_is_left_for_later(monkeypatch, tmp_path):
    """`build_ahead` without waiting returns False on a run whose lock another
    process holds, builds it once free, and finds it built after."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    planted = _Planted(monkeypatch)
    gm, x = _relu_graph(), torch.ones(4, 8)
    folder = kernel_cache.cache_folder()
    folder.mkdir(parents=True)
    with file_lock(folder / f"{kernel_cache.artifact_key(gm, [x], CPU)}.lock"):
        assert kernel_cache.build_ahead(gm, [x], CPU, wait=False) is False
    assert not planted.built
    assert kernel_cache.build_ahead(gm, [x], CPU, wait=False) is True
    assert kernel_cache.build_ahead(gm, [x], CPU, wait=True) is True
    assert len(planted.built) == 1


def _noted_runs(count: int) -> list:
    """`count` runs of other shapes, each with a variant its first step noted."""
    runs = [fused.InductorRun(*_accumulating_run(), CPU, f"run {n}", rehearsing=lambda: True)
            for n in range(count)]
    for n, run in enumerate(runs):
        run(None, torch.ones(n + 1))
    return runs


def test_a_rank_builds_first_the_runs_no_peer_is_building(monkeypatch, tmp_path):
    """While a peer holds the first run's lock, the rank builds the others,
    then waits for that one."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    planted = _Planted(monkeypatch)
    runs = _noted_runs(4)
    task, = runs[0].noted_tasks()
    *_, folder, key = kernel_cache._artifact(*builds.task_graph(task))
    rank = threading.Thread(target=builds.build_noted, args=(runs,))
    with file_lock(folder / f"{key}.lock"):  # the peer, building it
        rank.start()
        deadline = time.monotonic() + 20
        while len(planted.built) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(planted.built) == 3 and f"{key}.pt2" not in planted.built, planted.built
    rank.join(20)
    assert planted.built[3] == f"{key}.pt2" and not any(run.noted for run in runs)


def test_rank_class_members_share_their_builds_out(monkeypatch, tmp_path):
    """Two ranks with equal runs build what their first steps noted at once:
    each run is built once, half of them by each rank (each leaves the run
    the other is building for later, and finds it built then)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    planted = _Planted(monkeypatch)
    members = [_noted_runs(4), _noted_runs(4)]
    start = threading.Barrier(2)

    def member(runs):
        start.wait(10)
        builds.build_noted(runs)

    threads = [threading.Thread(target=member, args=(runs,), name=f"rank {i}")
               for i, runs in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(planted.built) == len(set(planted.built)) == 4, planted.built
    assert sorted(planted.by) == ["rank 0", "rank 0", "rank 1", "rank 1"], planted.by
    assert not any(run.noted for runs in members for run in runs)


def test_the_first_step_runs_eager_kernels_and_notes_what_to_build(monkeypatch, tmp_path):
    """The job's first step: each variant's graph with eager kernels, marked
    as its build will mark it (the first gradient owned, the next added into
    it in place), nothing built; the next step builds both variants, then
    loads them at their first calls."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    planted = _Planted(monkeypatch)
    step = [0]
    run = fused.InductorRun(*_accumulating_run(), CPU, "planted",
                            rehearsing=lambda: step[0] == 0)
    g = torch.ones(3)
    first = run(None, g)[0]
    second = run(first, g)[0]
    assert getattr(first, kernels.OWNED, False) and second is first
    assert torch.equal(second, g * 4)
    assert not planted.built and len(run.noted) == 2 and not run.built
    step[0] = 1
    builds.build_noted([run])
    assert len(planted.built) == 2 and not run.noted
    third = run(None, g)[0]
    assert run(third, g)[0] is third and torch.equal(third, g * 4)
    assert len(planted.built) == 2 and len(run.built) == 2


def test_a_warm_cache_rehearses_without_a_profiler(monkeypatch, tmp_path):
    """The rehearsal's bytes are measured once a machine, kept beside the
    run's artifact: a later process (a warm cache) counts the same bytes
    without starting a profiler (seconds a step 0 of 8 ranks)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    measured = []
    real = kernel_cache.measured
    monkeypatch.setattr(kernel_cache, "measured",
                        lambda fn, args: measured.append(1) or real(fn, args))
    mem = [[], []]
    for seen in mem:  # two processes of a machine, one after the other
        run = fused.InductorRun(*_accumulating_run(), CPU, "planted",
                                mem=types.SimpleNamespace(transient=seen.append),
                                rehearsing=lambda: True)
        g = torch.ones(3)
        run(run(None, g)[0], g)
    assert len(measured) == 2  # the first process's two variants, the second's none
    assert mem[0] == mem[1] and mem[0][0] > 0  # the first variant's output, at least


@pytest.mark.parametrize("make", [
    lambda: torch.ones(4, 8), lambda: torch.ones(8, 4).t(), lambda: torch.ones(8).expand(4, 8),
    lambda: torch.ones(33)[1:].view(4, 8), lambda: torch.ones(9, dtype=torch.bool)[1:],
    lambda: kernels.own(torch.ones(4, 8)), lambda: torch.ones(0, 8), lambda: torch.tensor(2.0)],
    ids=["dense", "transposed", "expanded", "unaligned", "bool", "owned", "empty", "scalar"])
def test_an_example_has_the_metas_of_its_input(make):
    """What a step notes to build later is a template, not the input's data;
    the example made from it gets the artifact the input would."""
    a = make()
    e = kernel_cache.example(kernel_cache.template(a))
    assert kernel_cache.input_metas([e]) == kernel_cache.input_metas([a])
    assert not a.numel() or e.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


def test_a_refused_run_is_not_built_again(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    planted = _Planted(monkeypatch, fail="planted: no lowering\nsecond line")
    gm, x = _relu_graph(), torch.ones(4, 8)
    for _ in range(2):
        with pytest.raises(kernel_cache.Refused, match=r"^RuntimeError: planted: no lowering$"):
            kernel_cache.ahead_of_time(gm, [x], CPU)
    assert len(planted.built) == 1
    assert not list((tmp_path / "meshplan-aot").glob("*.pt2"))  # nothing half built


def test_none_inputs_are_part_of_the_graph(monkeypatch, tmp_path):
    """An accumulator before its first gradient is None: the run is built
    without that input, and called with the others."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    planted = _Planted(monkeypatch)
    run = fused.InductorRun(*_accumulating_run(), CPU, "planted")
    g = torch.ones(3)
    out = run(None, g)
    assert torch.equal(out[0], g * 2)
    assert [n.op for n in planted.gm.graph.nodes].count("placeholder") == 1
    assert getattr(out[0], kernels.OWNED, False)  # the run's own buffer: later ones add into it


def test_a_first_gradient_is_owned_only_where_the_run_made_it(monkeypatch, tmp_path):
    """A built run's first gradient is owned (later micro-batches add into it
    in place) where it is a buffer of the run's own; one that is an input, or
    that two accumulators adopt, is borrowed, as eager kernels keep them all:
    never written, the next micro-batch adds out of place."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    _Planted(monkeypatch)
    mul = "aten.mul.Tensor"  # d = g * 2 (two adopt it), e = g * 3; one adopts g itself
    ops = [Op(0, mul, (Ref(1), 2), (2,)), Op(1, mul, (Ref(1), 3), (3,)),
           Op(2, k.ACCUMULATE_GRAD, (Ref(10), Ref(2)), (20,)),
           Op(3, k.ACCUMULATE_GRAD, (Ref(11), Ref(2)), (21,)),
           Op(4, k.ACCUMULATE_GRAD, (Ref(12), Ref(1)), (22,)),
           Op(5, k.ACCUMULATE_GRAD, (Ref(13), Ref(3)), (23,))]
    run = fused.InductorRun(ops, [1, 10, 11, 12, 13], [20, 21, 22, 23], CPU, "planted")
    g = torch.ones(3)
    first = run(g, None, None, None, None)
    assert [bool(getattr(t, kernels.OWNED, False)) for t in first] == [False, False, False, True]
    second = run(g, *first)
    assert second[3] is first[3] and torch.equal(second[3], g * 6)  # in place, its own
    assert all(second[i] is not first[i] for i in range(3))  # out of place: borrowed ones
    assert torch.equal(first[0], g * 2) and torch.equal(g, torch.ones(3))  # never written
    assert [torch.equal(t, g * c) for t, c in zip(second, (4, 4, 2, 6))] == [True] * 4


def _accumulating_run():
    """ops: d = g * 2; acc' = accumulate_grad(acc, d); inputs (acc, g)."""
    ops = [Op(0, "aten.mul.Tensor", (Ref(1), 2), (2,)),
           Op(1, k.ACCUMULATE_GRAD, (Ref(0), Ref(2)), (3,))]
    return ops, [0, 1], [3]


def _sin_vjp(x, g):
    return torch.func.vjp(torch.sin, x)[1](g)[0]


def _vjp_graph():
    g = torch.fx.Graph()
    x, gout = g.placeholder("a0"), g.placeholder("a1")
    g.output((g.call_function(_sin_vjp, (x, gout)),))
    return torch.fx.GraphModule(torch.nn.Module(), g)


_WARM = """
import sys, torch
from meshplan.runtime.kernel_cache import ahead_of_time
from tests.runtime.test_kernel_cache import _relu_graph
x = torch.randn(4, 8)
out = ahead_of_time(_relu_graph(), [x], torch.device("cpu"))(x)
assert torch.equal(out[0], torch.relu(x))
print(sorted(m for m in ("torch._inductor", "torch._dynamo") if m in sys.modules))
"""


@pytest.mark.slow
@pytest.mark.skipif(not fused.can_compile(), reason="no C++ compiler for Inductor on cpu")
def test_a_built_run_loads_without_inductor_and_keeps_eager_semantics(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def fresh_process() -> str:
        p = subprocess.run([sys.executable, "-c", textwrap.dedent(_WARM)], capture_output=True,
                           text=True, timeout=300, cwd=str(kernel_cache.Path(__file__).parents[2]))
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout.strip()

    assert fresh_process() == "['torch._dynamo', 'torch._inductor']"  # cold: it builds
    assert fresh_process() == "[]"  # warm: a dlopen, nothing traced or compiled
    # strides: a transposed input gets its own artifact, not the contiguous one's
    gm = torch.fx.symbolic_trace(lambda a, b: (a + b,))
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    for x in (b, b.t()):
        assert torch.equal(kernel_cache.ahead_of_time(gm, [a, x], CPU)(a, x)[0], a + x)
    # a generic gradient (`torch.func.vjp`): traced to aten ops, not frozen at its example
    gm = _vjp_graph()
    for x in (torch.randn(8), torch.randn(8)):
        got = kernel_cache.ahead_of_time(gm, [x, b[0]], CPU)(x, b[0])[0]
        assert torch.allclose(got, torch.cos(x) * b[0], atol=1e-6), (got, x)
    # the accumulators' protocol, micro-batch by micro-batch: the run's own first gradient
    # owned, later ones added into it in place: two variants built, not three
    run = fused.InductorRun(*_accumulating_run(), CPU, "accumulate")
    g = torch.ones(3)
    first = run(None, g)[0]
    second = run(first, g)[0]
    third = run(second, g)[0]
    assert getattr(first, kernels.OWNED, False)
    assert third is second is first and torch.equal(third, g * 6)
    assert len(run.built) == 2
    assert not run.note, run.note


def test_a_runs_scratch_is_its_own_allocations_at_their_high_water():
    """Three 64 KiB buffers alive at once: 192 KiB, whatever another thread
    (a rank on threads) allocates meanwhile."""
    x = torch.ones(128, 128)
    busy, stop = threading.Event(), threading.Event()

    def other_rank():
        while not stop.is_set():
            torch.empty(1 << 20).fill_(1.0)
            busy.set()

    def run(x):
        a = x * 2
        b = a + 1
        c = b * b
        return [c.sum()]

    t = threading.Thread(target=other_rank, daemon=True)
    t.start()
    try:
        assert busy.wait(10)
        out, scratch = kernel_cache.measured(run, [x])
    finally:
        stop.set()
        t.join(10)
    assert out[0].item() == 128 * 128 * 9
    assert 3 * x.nbytes <= scratch < 3 * x.nbytes + 1024, scratch


@pytest.mark.parametrize("device, local, runs, expected", [
    ("cpu", 1, 10, 7),  # every spare core
    ("cpu", 1, 3, 2),  # a run each, the rank's own first
    ("cpu", 1, 1, 0),  # the rank builds it
    ("cpu", 4, 10, 1),
    ("cpu", 8, 10, 0),  # no core spare
    ("cpu", 16, 10, 0),
    ("cuda", 1, 10, 0),  # a device context each: never
])
def test_helpers_take_the_spare_cores(monkeypatch, device, local, runs, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)), raising=False)
    assert builds.helper_count(torch.device(device), local, runs) == expected


def test_a_helper_gets_the_tasks_the_rank_noted():
    """A task as JSON (what a helper reads) makes the graph, and key, the
    rank's makes; one holding what JSON cannot starts no helper."""
    run = fused.InductorRun(*_accumulating_run(), CPU, "run", rehearsing=lambda: True)
    run(None, torch.ones(3, dtype=torch.float64)[1:])  # unaligned, a first gradient
    run(kernels.own(torch.ones(2, dtype=torch.float64)), torch.ones(2, dtype=torch.float64))
    tasks = run.noted_tasks()
    back = [builds._task_from_json(d)
            for d in json.loads(builds._tasks_to_json(tasks))["tasks"]]
    keys = [kernel_cache._artifact(*builds.task_graph(t))[3] for t in (*tasks, *back)]
    assert len(set(keys)) == 2 and keys[:2] == keys[2:]
    odd = [(*t[:3], [(*tp[:5], {"mark": object()}) for tp in t[3]], t[4]) for t in tasks[1:]]
    assert builds._tasks_to_json(odd) is None
    with builds.beside(odd, 1) as procs:
        assert procs == []


def test_a_rank_builds_alone_where_no_helper_starts(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    planted = _Planted(monkeypatch)
    monkeypatch.setattr(builds, "helper_count", lambda *_: 1)

    def no_process(*_, **__):
        raise OSError("planted: no process to spare")

    monkeypatch.setattr(builds.subprocess, "Popen", no_process)
    builds.build_noted(_noted_runs(2))
    assert len(planted.built) == 2


@pytest.mark.slow
@pytest.mark.skipif(not fused.can_compile(), reason="no C++ compiler for Inductor on cpu")
def test_a_helper_builds_the_runs_the_rank_loads(monkeypatch, tmp_path):
    """A helper builds a rank's noted runs while the rank builds none; then
    each run's next first call loads its package (no build in the rank),
    and the helper has ended."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.set_num_threads(1)  # a helper left at its default (this machine's cores) mis-keys
    runs = [fused.InductorRun(*_accumulating_run(), CPU, f"run {n}", rehearsing=lambda: True)
            for n in range(1)]
    for n, run in enumerate(runs):  # step 0: an owned gradient added into
        run(kernels.own(torch.zeros(n + 2)), torch.ones(n + 2))
    tasks = [task for run in runs for task in run.noted_tasks()]
    assert len(tasks) == 1
    with builds.beside(tasks, 1) as procs:
        deadline = time.monotonic() + 300
        while not all(kernel_cache.is_built(*builds.task_graph(t)) for t in tasks):
            assert time.monotonic() < deadline and procs[0].poll() is None, "no build"
            time.sleep(0.5)
    assert procs[0].poll() is not None  # ended on the way out
    assert len(list((tmp_path / "meshplan-aot").glob("*.pt2"))) == 1

    def no_build(*_):
        raise AssertionError("the rank built a run its helper built")

    monkeypatch.setattr(kernel_cache, "build", no_build)
    for n, run in enumerate(runs):
        run.rehearsing, acc = (lambda: False), kernels.own(torch.ones(n + 2))
        assert run(acc, torch.ones(n + 2))[0] is acc and torch.equal(acc, torch.full((n + 2,), 3.))
    assert sum(len(run.built) for run in runs) == 1


def _custom_run():
    """ops: h = x * 2; r = RoundSTE(h) (a Function kept whole, the custom op
    of `ops/function_op.py`); y = scaled_tanh(r, w) (a custom op of
    `tests.ops.custom_ops_toy`); inputs x, w."""
    from tests.capture.functions_toy import RoundSTE
    from tests.ops import custom_ops_toy  # noqa: F401  (registers scaled_tanh here)

    layout, _ = function_op.spelled(RoundSTE, ((torch.empty(0),), {}))
    ops = [Op(0, "aten.mul.Tensor", (Ref(0), 2), (2,)),
           Op(1, function_op.KIND, (function_op.path_of(RoundSTE), json.dumps(layout),
                                    (Ref(2),)), (3,)),
           Op(2, "meshplan_test.scaled_tanh.default", (Ref(3), Ref(1)), (4,))]
    return ops, [0, 1], [4]


@pytest.mark.slow
@pytest.mark.skipif(not fused.can_compile(), reason="no C++ compiler for Inductor on cpu")
def test_a_helper_imports_the_modules_of_its_runs_custom_ops(monkeypatch, tmp_path):
    """A helper, a fresh process, builds a run holding custom ops: it
    imports their modules first (before, it kept the run as refused, an
    unknown op, and the rank obeyed the refusal)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.set_num_threads(1)
    run = fused.InductorRun(*_custom_run(), CPU, "run", rehearsing=lambda: True)
    x, w = torch.tensor([0.3, 1.4, -2.6]), torch.tensor([1.0, 0.5, 2.0])
    expected = torch.tanh(torch.round(x * 2)) * w
    assert torch.equal(run(x, w)[0], expected)
    tasks = run.noted_tasks()
    assert json.loads(builds._tasks_to_json(tasks))["modules"] == [
        "meshplan.ops.function_op", "tests.capture.functions_toy", "tests.ops.custom_ops_toy"]
    with builds.beside(tasks, 1) as procs:
        deadline = time.monotonic() + 300
        while not all(kernel_cache.is_built(*builds.task_graph(t)) for t in tasks):
            assert time.monotonic() < deadline and procs[0].poll() is None, "no build"
            time.sleep(0.5)
    folder = tmp_path / "meshplan-aot"
    assert [p.read_text() for p in folder.glob("*.refused")] == []
    assert len(list(folder.glob("*.pt2"))) == 1
    run.rehearsing = lambda: False
    torch.testing.assert_close(run(x, w)[0], expected)
