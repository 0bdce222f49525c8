"""Device and backend choice: refused before any process starts, one line
each; `best` picks cpu where there is no CUDA."""

from __future__ import annotations

import pytest
import torch

from meshplan.cli.main import main
from meshplan.errors import ConfigError
from meshplan.runtime import devices

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_best_is_cpu_without_cuda():
    assert devices.resolve_device("best") == "cpu"


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("verb", [["run", "--steps", "1"], ["verify", "--steps", "1"], ["demo"]])
def test_device_cuda_without_cuda_is_one_line(verb, capsys):
    assert main(verb + ["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device here" in err[0] and "--device cpu" in err[0]


def test_nccl_on_cpu_is_refused():
    with pytest.raises(ConfigError, match="needs --device cuda"):
        devices.resolve_backend("cpu", "nccl", 1)


def test_more_ranks_than_gpus_needs_gloo(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 1)
    with pytest.raises(ConfigError, match="add --backend gloo"):
        devices.resolve_backend("cuda", "", 4)
    assert devices.resolve_backend("cuda", "gloo", 4) == "gloo"
    assert devices.resolve_backend("cuda", "", 1) == "nccl"
    assert devices.resolve_backend("cpu", "", 8) == "gloo"


def test_compile_for_cuda_needs_no_gpu_and_checks(tmp_path, capsys):
    out = tmp_path / "plans"
    assert main(["-q", "compile", "--device", "cuda", "--devices-per-node", "2", "--pp", "2",
                 "--precision", "bf16", "--out", str(out), "--workers", "1"]) == 0
    assert main(["check", str(out)]) == 0
    assert "consistent" in capsys.readouterr().out
    # a cpu run of cuda plans is refused before any rank starts
    assert main(["run", "--plan-dir", str(out), "--devices-per-node", "2", "--pp", "2",
                 "--precision", "bf16", "--steps", "1"]) == 2
    assert "lowered for cuda" in capsys.readouterr().err


def test_help_says_gloo_on_cuda_is_not_for_speed(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "not for speed" in " ".join(capsys.readouterr().out.split())
