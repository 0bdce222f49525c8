"""An op emitter: the one way capture, autodiff and later passes add ops.

Invariant: every emitted op gets its outputs from logical inference
(`ops.infer`), and inherits the emitter's phase, module path, source and
`grad_of`, so provenance is never lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.ir import Arg, GraphBuilder, Phase, Ref, TensorMeta
from meshplan.ops.infer import infer_outputs


@dataclass(slots=True)
class Emitter:
    """Adds ops to `builder` with shared provenance."""

    builder: GraphBuilder
    phase: Phase = Phase.FORWARD
    module_path: str = ""
    source: str = ""
    grad_of: int = -1

    def meta(self, r: Ref) -> TensorMeta:
        return self.builder.meta(r.id)

    def call_multi(self, kind: str, *args: Arg, **kwargs: Arg) -> tuple[Ref, ...]:
        """Emit `kind(*args, **kwargs)`; returns a Ref per output."""
        kw = tuple(kwargs.items())
        metas = infer_outputs(kind, args, kw, self.builder.meta)
        outs = self.emit(kind, args, metas, kw)
        return tuple(Ref(o) for o in outs)

    def call(self, kind: str, *args: Arg, **kwargs: Arg) -> Ref:
        """Emit a single-output op."""
        (out,) = self.call_multi(kind, *args, **kwargs)
        return out

    def emit(self, kind: str, args: Sequence[Arg], metas: Sequence[TensorMeta | None],
             kwargs: Sequence[tuple[str, Arg]] = ()) -> tuple[int, ...]:
        """Emit with known output metas (no inference)."""
        return self.builder.add_op(
            kind, tuple(args), tuple(metas), kwargs=tuple(kwargs), phase=self.phase,
            module_path=self.module_path, source=self.source, grad_of=self.grad_of,
        )
