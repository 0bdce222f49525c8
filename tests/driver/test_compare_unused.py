"""A parameter the step never reads: no rank holds it, and the verdict
accepts that only where eager left it unchanged as well."""

from __future__ import annotations

import torch

from meshplan.driver.compare import BOUNDS, assemble, compare_state
from meshplan.ir.choices import Precision

B = BOUNDS[Precision.FP32]


def _verdict(ref_value: torch.Tensor, start_value: torch.Tensor) -> dict:
    held = {0: {"used|0:2,0:3": torch.ones(2, 3)}}
    ref = {"used": torch.ones(2, 3), "unused": ref_value}
    shapes = {k: tuple(t.shape) for k, t in ref.items()}
    return compare_state(assemble(held, shapes), ref, B, start={"unused": start_value,
                                                                 "used": torch.zeros(2, 3)})


def test_an_unread_parameter_eager_left_alone_is_unused_not_missing():
    d = _verdict(torch.full((4,), 0.5), torch.full((4,), 0.5))
    assert d["unused"] == {"max_abs": 0.0, "max_rel": 0.0, "bound_used": 0.0, "ok": True,
                           "unused": True}
    assert d["used"]["ok"]


def test_a_parameter_eager_changed_but_no_rank_holds_is_missing():
    d = _verdict(torch.full((4,), 0.4), torch.full((4,), 0.5))
    assert d["unused"]["missing"] and not d["unused"]["ok"]


def test_without_a_start_state_a_missing_tensor_fails():
    held = {0: {}}
    ref = {"w": torch.ones(2)}
    d = compare_state(assemble(held, {"w": (2,)}), ref, B)
    assert d["w"]["missing"] and not d["w"]["ok"]
