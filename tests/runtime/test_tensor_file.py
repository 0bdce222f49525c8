"""The run-inputs file: tensors round-trip exactly, nothing is unpickled,
an edited file is refused."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.errors import PlanError
from meshplan.runtime.tensor_file import load_inputs, save_inputs

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3)


@settings(max_examples=25, deadline=None)
@given(w=st.lists(st.tuples(st.sampled_from(DTYPES), shapes), max_size=4),
       b=st.lists(st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=3),
                  max_size=3))
def test_round_trip_is_exact(tmp_path_factory, w, b):
    def make(dtype, shape):
        return (torch.randn(shape) * 3).to(dtype)

    weights = {f"m.{i}.weight": make(*x) for i, x in enumerate(w)}
    batches = [tuple(make(*x) for x in step) for step in b]
    path = tmp_path_factory.mktemp("in") / "inputs.bin"
    save_inputs(path, weights, batches)
    w2, b2 = load_inputs(path)
    assert w2.keys() == weights.keys() and len(b2) == len(batches)
    for x, y in zip(list(weights.values()) + [t for s in batches for t in s],
                    list(w2.values()) + [t for s in b2 for t in s]):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_an_edited_payload_is_refused(tmp_path):
    path = tmp_path / "inputs.bin"
    save_inputs(path, {"w": torch.ones(4)}, [(torch.zeros(2),)])
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(PlanError, match="checksum"):
        load_inputs(path)
