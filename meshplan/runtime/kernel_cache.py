"""Inductor runs compiled once per machine, ahead of their use, and loaded by
every rank without Inductor (`--kernels inductor`, docs/concepts/kernels.md).

Invariants:
- A run's artifact is a package (a shared library) that AOTInductor makes
  from the run's graph (`fused.graph_of`), traced by `torch.export` on the
  run's real inputs: static shapes, strides and dtypes. Export freezes the
  tensors inside `torch.func`'s transforms (a generic gradient) as
  constants; such a graph is traced to aten ops by `make_fx` first. A
  traced graph still holding a tensor constant is refused: a run has no
  tensor of its own, so such a constant is an input frozen at its example
  value. The artifact's name is `artifact_key`: every fact its code
  depends on (the graph's code, its inputs' metas and alignment, torch's
  version, the device's capability, the threads a CPU kernel is built
  for, the source of meshplan's own kernels in the graph).
- Loading an artifact is a `dlopen` through torch's own AOTI package loader
  (`torch._C._aoti`): it imports neither Inductor nor dynamo and traces
  nothing, so a rank whose runs are built pays no compile at all.
- An artifact is built under a file lock per key, in one folder per machine
  (`cache_folder`): of the processes that need the same run (a rank class's
  members, equal stages), one builds and the others wait and load. The
  builder waits on no other rank (a run holds no communication), so no
  cycle can form. A build is written in a scratch folder and renamed into
  place: no process ever loads half a package.
- A run export or Inductor refuses leaves a note in its artifact's place
  (`<key>.refused`, the reason), so no later process builds it again; the
  caller runs it eagerly with that note.
- Building neither runs the graph nor writes its inputs (export and Inductor
  trace fake tensors): the caller's first call is the run's first execution.
- Beside an artifact lie the bytes its run allocates (`<key>.scratch`) and
  those its rehearsal on eager kernels allocates (`<key>.eager-scratch`),
  each measured by the first process that runs it (`measured_once`).
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import hashlib
import os
import platform
import sys
import tempfile
import threading
import types
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from meshplan.ir.fileio import built_file, file_lock, read_bytes, write_atomic

FORMAT = 1  # bump when what an artifact holds, or how it is built, changes
ALIGN = 16  # bytes: Inductor's kernels may assume inputs aligned to this when traced so


class Refused(Exception):
    """Export or Inductor cannot build this run; the message says why."""


def input_metas(args) -> tuple:
    """What a built run assumes of its inputs, each: shape, strides, dtype,
    device, whether its data is `ALIGN`-aligned, and the Python attributes it
    carries (a kernel may read one: `accumulate_grad`'s mark of ownership).
    A call with other metas needs another artifact."""
    return tuple((a.shape, a.stride(), a.dtype, a.device.type, a.data_ptr() % ALIGN == 0,
                  tuple(sorted(a.__dict__.items())))
                 if isinstance(a, torch.Tensor) else type(a) for a in args)


def artifact_key(gm: fx.GraphModule, args, device: torch.device) -> str:
    """The name of a run's artifact: a hash of everything its code depends on."""
    if device.type == "cuda":
        target = f"cuda {torch.cuda.get_device_capability(device)} {torch.version.cuda}"
    else:
        target = f"cpu {torch.backends.cpu.get_cpu_capability()} {platform.machine()}"
    facts = [f"format {FORMAT}", torch.__version__, target,
             f"threads {torch.get_num_threads()}", gm.code, repr(input_metas(args)),
             *(_source_hash(m) for m in sorted(_python_kernels(gm)))]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:40]


def cache_folder() -> Path:
    """`$TORCHINDUCTOR_CACHE_DIR/meshplan-aot`, or the same under Inductor's
    own default folder (`<tmp>/torchinductor_<user>`): shared by the
    processes of a machine, and emptied with Inductor's cache."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{_user()}")
    return Path(root) / "meshplan-aot"


def ahead_of_time(gm: fx.GraphModule, args, device: torch.device) -> Callable:
    """The run `gm` built for `args`' metas, as `f(*args) -> [outputs]`:
    loaded from this machine's cache, built into it first if no process has;
    raises `Refused` if export or Inductor cannot build it. An input that is
    None (an accumulator before its first gradient) is part of the graph."""
    bound, tensors, folder, key = _artifact(gm, args, device)
    _build_once(bound, tensors, folder, key, wait=True)
    refused = folder / f"{key}.refused"
    if refused.exists():
        raise Refused(read_bytes(refused).decode())
    lib = folder / f"{key}.pt2"
    run = load(lib, device)
    call = run if len(tensors) == len(args) else \
        lambda *xs: run(*(x for x in xs if x is not None))
    call.artifact = lib  # type: ignore[attr-defined]  # where its measured scratch is kept
    return call


def build_ahead(gm: fx.GraphModule, args, device: torch.device, wait: bool) -> bool:
    """Build the run `gm` for `args`' metas into this machine's cache, unless
    a process has (a refusal is kept as `ahead_of_time` keeps it); loads
    nothing. With `wait` False it leaves a run another process is building
    and returns False: members of a rank class building their runs in the
    same order so share them out, rather than each waiting on the same one."""
    try:
        found = _artifact(gm, args, device)
    except Refused:  # `ahead_of_time` refuses it at its call
        return True
    return _build_once(*found, wait=wait)


def is_built(gm: fx.GraphModule, args, device: torch.device) -> bool:
    """Whether this machine's cache holds the run `gm` for `args`' metas (or
    its refusal)."""
    lib = _beside(gm, args, device, ".pt2")
    return lib is None or lib.exists() or lib.with_suffix(".refused").exists()


def rehearsal_file(gm: fx.GraphModule, args, device: torch.device) -> Path | None:
    """Where the bytes the rehearsal of the run `gm` on `args`' metas
    allocates (its eager kernels', `fused.InductorRun._rehearse`) are kept
    on this machine, beside its artifact: a warm cache measures no run."""
    return _beside(gm, args, device, ".eager-scratch")


def _beside(gm: fx.GraphModule, args, device: torch.device, suffix: str) -> Path | None:
    """The file `suffix` of the run's artifact; None for a run refused before
    any key (an input neither a tensor nor None)."""
    try:
        _, _, folder, key = _artifact(gm, args, device)
    except Refused:
        return None
    return folder / f"{key}{suffix}"


def _artifact(gm: fx.GraphModule, args, device: torch.device):
    """(graph with its None inputs bound, tensor inputs, cache folder, key)."""
    if not all(a is None or isinstance(a, torch.Tensor) for a in args):
        raise Refused("an input is neither a tensor nor None")
    bound = bind_none(gm, [a is None for a in args])
    tensors = [a for a in args if a is not None]
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    return bound, tensors, folder, artifact_key(bound, tensors, device)


def _build_once(bound: fx.GraphModule, tensors, folder: Path, key: str, wait: bool) -> bool:
    """The artifact `key` (or its refusal) built under its file lock, if no
    process has; False if `wait` is False and another process holds the lock."""
    lib, refused = folder / f"{key}.pt2", folder / f"{key}.refused"
    if lib.exists() or refused.exists():
        return True
    with file_lock(folder / f"{key}.lock", wait=wait) as held:
        if held and not lib.exists() and not refused.exists():
            try:
                build(bound, tensors, lib)
            except Exception as err:  # a refusal: the run stays eager, with the reason
                first = (str(err).strip() or type(err).__name__).splitlines()[0]
                write_atomic(refused, f"{type(err).__name__}: {first[:300]}".encode())
    return held


def template(a):
    """What building a run needs of input `a`, without holding its data:
    its `input_metas` (an input that is not a tensor as it is)."""
    if not isinstance(a, torch.Tensor):
        return a
    return (tuple(a.shape), a.stride(), a.dtype, a.device, a.data_ptr() % ALIGN == 0,
            dict(a.__dict__))


def example(t):
    """An input with the metas `template` kept (its values unset: a build
    traces fake tensors)."""
    if not isinstance(t, tuple):
        return t
    shape, stride, dtype, device, aligned, attrs = t
    offset = 0 if aligned else 1  # one element off: unaligned for elements under ALIGN bytes
    size = offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) \
        else offset
    x = torch.empty(size, dtype=dtype, device=device).as_strided(shape, stride, offset)
    x.__dict__.update(attrs)
    return x


def bind_none(gm: fx.GraphModule, none: list[bool]) -> fx.GraphModule:
    """`gm` with the inputs flagged in `none` fixed to None (gone from its
    placeholders): the graph a run is built as for such a call."""
    if not any(none):
        return gm
    g = fx.Graph()
    env: dict[fx.Node, object] = {}
    inputs = iter(none)
    for node in gm.graph.nodes:
        if node.op == "placeholder" and next(inputs):
            env[node] = None
        else:
            env[node] = g.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, g)


def build(gm: fx.GraphModule, args, lib: Path) -> None:
    """AOTInductor's package of `gm` on inputs like `args`, at `lib`."""
    from torch._inductor import aoti_compile_and_package  # reason: only a cold cache builds
    from torch.fx.experimental.proxy_tensor import make_fx  # reason: as Inductor

    with built_file(lib) as scratch, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # export's and Inductor's deprecation chatter
        program = torch.export.export(gm, tuple(args), strict=False)
        if program.constants:  # `torch.func` in a generic gradient: its aten ops first
            program = torch.export.export(make_fx(gm, tracing_mode="fake")(*args), tuple(args))
        if program.constants:  # a run has no tensor of its own: one is an input frozen
            raise RuntimeError(f"export froze {len(program.constants)} tensors as constants")
        options = {}
        if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            # the glue between a CPU run's kernels: built 16% faster unoptimized (4.4 s
            # against 5.2 s for a small run), at a few microseconds a call
            options["aot_inductor.compile_wrapper_opt_level"] = "O0"
        aoti_compile_and_package(program, package_path=str(scratch / lib.name),
                                 inductor_configs=options)


def load(lib: Path, device: torch.device) -> Callable:
    """`f(*args) -> [outputs]` running the package `lib` on `device`: its
    None outputs in their places, and an output that is an input written in
    place returned as that very tensor (its identity, and what it carries,
    kept, as eager kernels keep them)."""
    index = device.index if device.type == "cuda" and device.index is not None else -1
    runner = torch._C._aoti.AOTIModelPackageLoader(str(lib), "model", False, 1, index)
    spec = pytree.treespec_loads(runner.get_call_spec()[1])
    # one tensor, or a tuple of tensors with no None among them: the flat list as it is
    flat = spec.is_leaf() or spec.num_leaves == spec.num_children
    run = runner.run  # bound: keeps the runner (and its library) alive
    same: list[tuple[int, int]] | None = None  # (output, input) pairs, found at the first call

    def call(*args):
        nonlocal same
        out = run(args)
        if not flat:
            out = list(pytree.tree_unflatten(out, spec))
        if same is None:
            same = [(i, j) for i, o in enumerate(out) for j, a in enumerate(args)
                    if o is not None and _is_view_of_all(o, a)]
        for i, j in same:
            out[i] = args[j]
        return out

    return call


def _is_view_of_all(o: torch.Tensor, a: torch.Tensor) -> bool:
    return (o.data_ptr() == a.data_ptr() and o.shape == a.shape and o.stride() == a.stride()
            and o.dtype == a.dtype)


def _python_kernels(gm: fx.GraphModule) -> set[str]:
    """The modules of the Python functions `gm` calls (meshplan's own
    kernels): their source is part of the code an artifact holds."""
    return {n.target.__module__ for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, types.FunctionType)}


@functools.cache
def _source_hash(module: str) -> str:
    path = getattr(sys.modules.get(module), "__file__", None)
    body = read_bytes(path) if path else module.encode()
    return f"{module} {hashlib.sha256(body).hexdigest()}"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        return str(os.getuid())


def measured_once(fn: Callable, args, known: Path | None) -> tuple[list, int]:
    """`measured(fn, args)`, its bytes kept in the file `known` (if any) for
    the processes that run it later: they run without a profiler (starting
    one costs a rank about half a second)."""
    if known is not None and known.exists():
        return fn(*args), int(read_bytes(known))
    out, scratch = measured(fn, args)
    if known is not None:
        write_atomic(known, str(scratch).encode())
    return out, scratch


_MEASURING = threading.Lock()  # one profiler a process: ranks on threads take turns


def measured(fn: Callable, args) -> tuple[list, int]:
    """`fn(*args)` run once, with the bytes it allocates on the CPU at its
    high-water mark (a built run's own buffers and its outputs; its inputs
    are the caller's): the allocator's events as `torch.profiler` records
    them, this thread's only."""
    from torch.profiler import ProfilerActivity, profile, record_function  # reason: measuring

    with _MEASURING:
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():  # kineto announces each start and stop there
            prof.start()
        try:
            with record_function(_MARK):
                out = fn(*args)
        finally:
            with _quiet_stderr():
                prof.stop()
    events = prof.profiler.kineto_results.events()
    mine = {e.start_thread_id() for e in events if e.name() == _MARK}
    live = peak = 0
    cpu = torch._C._autograd.DeviceType.CPU
    for e in sorted((e for e in events if e.name() == "[memory]" and e.device_type() == cpu
                     and e.start_thread_id() in mine), key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return out, peak


_MARK = "meshplan.measured_run"


@contextlib.contextmanager
def _quiet_stderr():
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
