"""Op kind strings to torch callables."""

from __future__ import annotations

from functools import cache
from typing import Callable

import torch

from meshplan.errors import CaptureError


@cache
def resolve_aten(kind: str) -> Callable:
    """`aten.linear.default` -> `torch.ops.aten.linear.default`."""
    parts = kind.split(".")
    if len(parts) != 3:
        raise CaptureError(f"op kind {kind!r} is not of the form namespace.name.overload")
    ns, name, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError) as e:
        raise CaptureError(f"unknown torch op {kind!r}: {e}") from e
