"""The streamed weights writer: its safetensors files are what the
safetensors library reads (every dtype, 0-d and empty tensors), its shards
follow the size limit, its sizes parse as transformers' do."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from meshplan.driver.weights_out import OutTensor, parse_size, plan_shards, write_shards
from meshplan.errors import ConfigError

TENSORS = {
    "a.weight": torch.randn(3, 5),
    "b.half": torch.randn(7).half(),
    "c.bf16": torch.randn(2, 2, 3).bfloat16(),
    "d.step": torch.tensor(4, dtype=torch.int64),
    "e.empty": torch.zeros(0, 4),
    "f.mask": torch.tensor([True, False, True]),
}


def _entries(tensors=TENSORS):
    return [OutTensor((n,), n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


def test_safetensors_read_back_by_the_library(tmp_path):
    files = write_shards(tmp_path, _entries(), TENSORS.__getitem__, "safetensors", 10**9)
    assert files == ["model.safetensors"]
    back = load_file(tmp_path / "model.safetensors")
    assert back.keys() == TENSORS.keys()
    for name, t in TENSORS.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    header_len = int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_shards_and_index(tmp_path):
    entries = _entries()
    files = write_shards(tmp_path, entries, TENSORS.__getitem__, "safetensors", 40)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = files[:-1]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in TENSORS.values())
    assert set(index["weight_map"]) == set(TENSORS)
    for name, t in TENSORS.items():
        assert torch.equal(load_file(tmp_path / index["weight_map"][name])[name], t)
    for f in shards:  # each within the limit, unless one tensor alone is larger
        data = load_file(tmp_path / f)
        size = sum(t.numel() * t.element_size() for t in data.values())
        assert size <= 40 or len(data) == 1


def test_torch_shard_keeps_aliases_one_tensor(tmp_path):
    w = torch.randn(4, 2)
    entries = [OutTensor(("wte.weight", "head.weight"), "wte.weight", (4, 2), torch.float32)]
    assert write_shards(tmp_path, entries, {"wte.weight": w}.__getitem__, "pt",
                        10**9) == ["model.pt"]
    sd = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sd["wte.weight"] is sd["head.weight"] and torch.equal(sd["wte.weight"], w)


def test_plan_shards_cuts_before_the_limit():
    e = [OutTensor((str(i),), str(i), (n,), torch.uint8) for i, n in enumerate([3, 3, 5, 1])]
    assert [[t.key for t in s] for s in plan_shards(e, 6)] == [["0", "1"], ["2", "3"]]
    assert [[t.key for t in s] for s in plan_shards(e, 4)] == [["0"], ["1"], ["2"], ["3"]]


@pytest.mark.parametrize("text,value", [("5GB", 5 * 10**9), ("200KB", 200_000),
                                        ("10MB", 10**7), ("1GiB", 2**30), ("123", 123),
                                        ("1.5MB", 1_500_000)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GB", "5XB", "-1GB", "0"])
def test_parse_size_refuses(text):
    with pytest.raises(ConfigError, match="--max-shard-size"):
        parse_size(text)
