"""Files of tensors that cross processes without pickle: a user's weights and
batches handed to locally spawned ranks, and each rank's final state handed
back to `verify`.

Format: a sealed JSON header line (`ir.fileio.seal`: format, version,
sha256) listing each tensor's key, dtype, shape, offset and length, then the
tensors' raw bytes, whose sha256 the header holds too. Inputs files key
weights `w/<fqn>` and the i-th tensor of a step's batch `b/<step>/<i>`;
state files key each slice `<state name>|<box>` (`checkpoint.box_key`).

Invariants: reading never unpickles anything (the program is in the Job;
only tensors travel); a truncated or edited file is a `PlanError`; the file
is written atomically.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from meshplan.errors import PlanError
from meshplan.ir.fileio import seal, unseal, write_atomic

INPUTS, STATE = "meshplan.run_inputs", "meshplan.rank_state"
VERSION = 1


def write_tensors(path: Path, kind: str, tensors: dict[str, torch.Tensor],
                  extra: dict | None = None) -> None:
    """Write `tensors` (key -> tensor) and the JSON-able `extra` to `path`."""
    index, chunks, off = [], [], 0
    for key, t in tensors.items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        index.append([key, str(t.dtype).removeprefix("torch."), list(t.shape), off, len(raw)])
        chunks.append(raw)
        off += len(raw)
    payload = b"".join(chunks)
    head = seal(kind, VERSION, (extra or {}) | {
        "tensors": index, "payload_sha256": hashlib.sha256(payload).hexdigest()})
    write_atomic(path, head + payload)


def read_tensors(path: Path, kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and the header body `write_tensors` wrote."""
    data = Path(path).read_bytes()
    cut = data.find(b"\n") + 1
    body = unseal(data[:cut], kind, VERSION, str(path))
    payload = data[cut:]
    if hashlib.sha256(payload).hexdigest() != body["payload_sha256"]:
        raise PlanError(f"{path}: checksum mismatch in the tensor data; run again")
    tensors: dict[str, torch.Tensor] = {}
    for key, dtype, shape, off, n in body["tensors"]:
        kind_ = getattr(torch, dtype)
        t = torch.frombuffer(bytearray(payload[off:off + n]), dtype=torch.uint8).view(kind_) \
            if n else torch.empty(0, dtype=kind_)
        tensors[key] = t.reshape(shape)
    return tensors, body


def save_inputs(path: Path, weights: dict[str, torch.Tensor], batches) -> None:
    """Write `weights` (FQN -> tensor) and `batches` (per step, a tuple of tensors)."""
    tensors = {f"w/{k}": t for k, t in weights.items()}
    for step, batch in enumerate(batches):
        tensors |= {f"b/{step}/{i}": t for i, t in enumerate(batch)}
    write_tensors(path, INPUTS, tensors, {"steps": len(batches)})


def load_inputs(path: Path) -> tuple[dict[str, torch.Tensor], list[tuple]]:
    """The weights and batches `save_inputs` wrote."""
    tensors, body = read_tensors(path, INPUTS)
    weights: dict[str, torch.Tensor] = {}
    steps: dict[int, dict[int, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith("w/"):
            weights[key[2:]] = t
        else:
            _, step, i = key.split("/")
            steps.setdefault(int(step), {})[int(i)] = t
    batches = [tuple(steps.get(k, {})[i] for i in sorted(steps.get(k, {})))
               for k in range(body["steps"])]
    return weights, batches
