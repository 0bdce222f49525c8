"""Capture cache: hits skip the capture, bad entries are rebuilt, keys see every part."""

import dataclasses
import logging
import os
from pathlib import Path

import pytest
import torch

from meshplan.capture import cache
from meshplan.capture.cache import cache_dir, cached, capture_key, entry_path
from meshplan.ir import DType, Graph, Role, TensorMeta, Value, graph_to_bytes
from meshplan.ir.graph_facts import GraphFacts
from meshplan.models import model_config


@pytest.fixture(autouse=True)
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _graph(n: int = 0) -> Graph:
    return Graph(values=(Value(0, TensorMeta((), DType("float32")), Role.DATA, f"x{n}"),),
                 ops=(), inputs=(0,), loss=0, facts=GraphFacts(model_class="Toy"))


class _Make:
    """A `make` that counts its calls."""

    def __init__(self, graph: Graph):
        self.graph, self.calls = graph, 0

    def __call__(self) -> Graph:
        self.calls += 1
        return self.graph


KEY = capture_key(model="toy", shapes=[[2, 3]])


def test_cache_dir(cache_env, monkeypatch):
    assert cache_dir() == cache_env
    assert entry_path(KEY) == cache_env / "capture" / f"{KEY}.json"
    monkeypatch.delenv("MESHPLAN_CACHE_DIR")
    monkeypatch.setenv("HOME", "/home/someone")
    assert cache_dir() == Path("/home/someone/.cache/meshplan")


def test_miss_then_hit():
    make = _Make(_graph())
    assert cached(KEY, make) == (_graph(), False)
    assert entry_path(KEY).read_bytes() == graph_to_bytes(_graph())
    again = _Make(_graph(1))
    assert cached(KEY, again) == (_graph(), True)
    assert again.calls == 0


def test_disabled_neither_reads_nor_writes():
    make = _Make(_graph())
    assert cached(KEY, make, enabled=False) == (_graph(), False)
    assert not entry_path(KEY).exists()
    cached(KEY, make)
    assert cached(KEY, make, enabled=False)[1] is False and make.calls == 3


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip", "empty", "invalid-graph"])
def test_bad_entry_is_rebuilt_with_a_warning(damage, caplog):
    cached(KEY, _Make(_graph()))
    path = entry_path(KEY)
    data = path.read_bytes()
    bad = {"truncate": data[: len(data) // 2], "garbage": b"\x00\xff not json",
           "flip": data.replace(b'"x0"', b'"y0"'), "empty": b"",
           "invalid-graph": graph_to_bytes(dataclasses.replace(_graph(), loss=5))}[damage]
    path.write_bytes(bad)
    make = _Make(_graph(2))
    with caplog.at_level(logging.WARNING, logger="meshplan"):
        assert cached(KEY, make) == (_graph(2), False)
    assert make.calls == 1
    assert any("capture cache: ignoring bad entry" in r.getMessage() for r in caplog.records)
    assert path.read_bytes() == graph_to_bytes(_graph(2))  # overwritten
    assert cached(KEY, _Make(_graph(3))) == (_graph(2), True)


def test_unwritable_cache_still_returns_the_graph(cache_env, caplog):
    cache_env.parent.joinpath("cache").write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, logger="meshplan"):
        assert cached(KEY, _Make(_graph())) == (_graph(), False)
    assert any("cannot store" in r.getMessage() for r in caplog.records)


def test_no_temp_files_left(cache_env):
    for i in range(3):
        cached(capture_key(i=i), _Make(_graph(i)))
    assert sorted(os.listdir(cache_env / "capture")) == sorted(
        f"{capture_key(i=i)}.json" for i in range(3))


def test_bad_key_is_refused():
    with pytest.raises(ValueError, match="not a capture_key"):
        cached("../../etc/passwd", _Make(_graph()))


def test_key_changes_with_every_part(monkeypatch):
    cfg = model_config("gpt", "tiny")
    base = dict(model=cfg, shapes=((2, 16),), dtypes=(torch.int64,), loss=None, lr=0.1)
    key = capture_key(**base)
    assert key == capture_key(**dict(reversed(base.items())))  # order of parts is irrelevant
    assert key == capture_key(**{**base, "shapes": [[2, 16]]})  # tuples key like lists
    changed = [
        {"model": model_config("gpt", "small") if cfg != model_config("gpt", "small")
         else model_config("bert", "tiny")},
        {"model": dataclasses.asdict(cfg)},  # a dict is not the dataclass
        {"shapes": ((2, 17),)},
        {"dtypes": (torch.int32,)},
        {"loss": "ce"},
        {"lr": 0.2},
        {"lr": 1},
        {"extra": True},
    ]
    keys = {capture_key(**{**base, **c}) for c in changed}
    assert key not in keys and len(keys) == len(changed)
    assert capture_key(**{k: v for k, v in base.items() if k != "lr"}) != key
    for obj, name, value in [(torch, "__version__", "0.0.1"),
                             (cache.meshplan, "__version__", "9.9.9"),
                             (cache, "_source_hash", lambda: "edited")]:
        with monkeypatch.context() as m:
            m.setattr(obj, name, value)
            assert capture_key(**base) != key, name


def test_key_refuses_values_without_a_stable_form():
    with pytest.raises(TypeError, match="cannot key a object"):
        capture_key(x=object())
    with pytest.raises(TypeError, match="keys must be strings"):
        capture_key(x={1: 2})
    assert capture_key(x=float("inf")) != capture_key(x="inf")
