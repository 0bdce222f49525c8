"""Running torch.export for a user: its noise kept off the terminal, a
`module.to()` that changes nothing let through, and its failures said in
one line that names the model's own code.

Invariants:
- `export_program` raises `CaptureError` for every failure of torch's, with
  the innermost line of the model's own code on the way to it (`raised_at`).
- What torch prints while it traces reaches stderr as it is, but for the
  graph so far it prints at an error (the user gets our line).
- Source paths are shortened the same way everywhere (`short`), so graphs
  and Jobs do not depend on where the code is checked out.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import traceback
import warnings
from contextlib import contextmanager, redirect_stderr

import torch
from torch import nn

from meshplan.capture.functions import kept_whole
from meshplan.errors import CaptureError

TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE_PARENT = os.path.dirname(_PACKAGE_DIR)
_ZOO_DIR = os.path.join(_PACKAGE_DIR, "models")
_FAKE_LOG = "torch._subclasses.fake_tensor"
_SHAPES_LOG = "torch.fx.experimental.symbolic_shapes"  # prints the graph at a data-dependent error


def export_program(model: nn.Module, args: tuple, name: str) -> torch.export.ExportedProgram:
    """`torch.export.export(model, args, strict=False)`, or one CaptureError
    naming `name` (the user's module) and the line of its code that failed."""
    try:
        with torch_noise(), _to_that_changes_nothing(), kept_whole():
            return torch.export.export(model, args, strict=False)
    except CaptureError:
        raise
    except Exception as e:  # torch raises many kinds; the first line says what
        if "DataDependent" in type(e).__name__:  # torch's first line names a symbol, not code
            raise CaptureError(f"torch.export failed on {name}: the forward branches on a "
                               f"tensor's value{_raised_at(e)}; compute both sides and pick "
                               "with torch.where, or move the check out of the forward") from e
        raise CaptureError(f"torch.export failed on {name}{_raised_at(e, '')}: "
                           f"{first_line(e)}; check that the inputs fit the model") from e


class _quiet:
    """Silence a logger for a while (torch's fake-tensor logger prints the
    traceback of an op that fails at export: the user gets our one line)."""

    def __init__(self, name: str):
        self.log = logging.getLogger(name)

    def __enter__(self):
        self.was, self.log.disabled = self.log.disabled, True

    def __exit__(self, *exc):
        self.log.disabled = self.was


@contextmanager
def torch_noise():
    """Silence torch's own noise while it traces (a failing op's traceback in
    the fake-tensor log, the graph so far that export prints at an error,
    pytree's deprecation warnings): the user gets our line."""
    printed = io.StringIO()
    try:
        with warnings.catch_warnings(), _quiet(_FAKE_LOG), _quiet(_SHAPES_LOG), \
                redirect_stderr(printed):
            warnings.filterwarnings("ignore", r".*treespec, LeafSpec", FutureWarning)
            yield
    except Exception as e:  # torch prints the graph so far to stderr: keep all but that
        graph = str(getattr(e, "partial_fx_graph", "") or "")
        sys.stderr.write(printed.getvalue().replace(graph + "\n", "") if graph
                         else printed.getvalue())
        raise
    sys.stderr.write(printed.getvalue())


@contextmanager
def _to_that_changes_nothing():
    """`module.to(dtype)` in a forward (Switch Transformers' router casts its
    classifier to fp32 each call) returns the module as it is when every
    tensor already has that dtype and device, as eager's `.to` leaves them:
    under export, whose parameters are fake tensors, `.to` would swap each
    for itself and fail. A `.to` that changes a tensor runs as it is."""
    to = nn.Module.to

    def unchanged_to(module, *args, **kwargs):
        device, dtype, _, fmt = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if fmt is None and all((device is None or t.device == device) and
                               (dtype is None or not t.is_floating_point() or t.dtype == dtype)
                               for t in tensors):
            return module
        return to(module, *args, **kwargs)

    nn.Module.to = unchanged_to  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = to  # type: ignore[method-assign]


def _models_code(path: str) -> bool:
    """A model's own source: not torch's, not code torch generates
    (`<string>`), not meshplan's but for its zoo (`meshplan/models`)."""
    return not path.startswith((TORCH_DIR, "<")) and (
        not path.startswith(_PACKAGE_DIR) or path.startswith(_ZOO_DIR))


def _raised_at(e: Exception, unknown: str = " (e.g. `if x.item() > 0`)") -> str:
    """` at file, line N (`code`)`: the innermost line of the model's own code
    on the way to `e`, or `unknown` when none."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _models_code(f.filename)]
    if not frames:
        return unknown
    f = frames[-1]
    return f" at {short(f'{f.filename}, line {f.lineno}')} (`{(f.line or '').strip()}`)"


def first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def short(loc: str) -> str:
    """A source path that does not depend on where the code is checked out:
    meshplan's own files relative to the package's parent, others relative to
    the working directory when inside it. Keeps graphs and Jobs byte-stable."""
    path, _, line = loc.partition(", line ")
    for root in (_PACKAGE_PARENT, os.getcwd()):
        if path.startswith(root + os.sep):
            path = os.path.relpath(path, root)
            break
    return f"{path}, line {line}" if line else path
