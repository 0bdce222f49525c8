"""Which device and backend a run uses, refused early and in one line.

Invariants:
- `resolve_device` turns `cpu | cuda | auto` into `cpu` or `cuda` (auto:
  cuda when `torch.cuda.is_available()`); asking for cuda where there is
  none is a `ConfigError` before any process starts.
- `resolve_backend`: nccl for cuda, gloo for cpu by default. NCCL puts one
  rank on one GPU, so a plan with more ranks than this machine's GPUs is
  refused with the way out (`--backend gloo`: ranks share the GPUs and
  communication is staged through host memory, for testing plans, not for
  speed). nccl on cpu is refused too.
- `rank_device` is the one place a rank picks its GPU:
  `torch.cuda.set_device(local rank)` (torchrun's LOCAL_RANK, else the
  local launcher's rank), modulo the GPU count when ranks share GPUs.
"""

from __future__ import annotations

import os

import torch

from meshplan.errors import ConfigError

DEVICES = ("cpu", "cuda", "best")
BACKENDS = ("gloo", "nccl")


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str) -> str:
    """`cpu` or `cuda` for `device` (cpu | cuda | best)."""
    if device not in DEVICES:
        raise ConfigError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "best":
        return "cuda" if cuda_count() else "cpu"
    if device == "cuda" and not cuda_count():
        raise ConfigError(f"--device cuda: no CUDA device here (torch {torch.__version__}, "
                          f"built for CUDA {torch.version.cuda or 'none'}); use --device "
                          "cpu, or --device best to take a GPU only where there is one")
    return device


def resolve_backend(device: str, backend: str, ranks_here: int) -> str:
    """The process-group backend for `ranks_here` ranks on this machine."""
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "nccl" and device != "cuda":
        raise ConfigError("--backend nccl needs --device cuda; use --backend gloo on cpu")
    if backend == "nccl" and ranks_here > 1 and ranks_here > cuda_count():
        raise ConfigError(f"--device cuda runs one rank per GPU (NCCL cannot put two ranks "
                          f"on one GPU), but this machine has {cuda_count()} GPU(s) for "
                          f"{ranks_here} ranks; add --backend gloo to share the GPUs with "
                          "host-staged communication (for testing plans, not for speed), or "
                          "plan fewer ranks per machine")
    return backend


def rank_device(device: str, rank: int, backend: str) -> torch.device:
    """This rank's device; for cuda, sets the current GPU (see the module doc)."""
    if device != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    n = cuda_count()
    if n == 0:
        raise ConfigError(f"rank {rank}: --device cuda but no CUDA device on this machine")
    if backend == "nccl" and local >= n:
        raise ConfigError(f"rank {rank} is local rank {local} but this machine has {n} "
                          "GPU(s); start at most one rank per GPU, or use --backend gloo")
    index = local % n
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
