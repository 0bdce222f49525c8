"""Export trained weights for transformers (`hf`) or torch (`torch`), from a
checkpoint or from a run's weights in memory.

Invariants:
- A checkpoint is trusted only as far as it proves itself: its `COMPLETE`
  marker (sealed), DCP's `.metadata` against the marker's digest before DCP
  reads it, and `model.json` against the marker's `files` digest. Each
  failure is one line, before anything is written.
- Only parameters and buffers are exported: optimizer slots and the
  step-level `optim@`/`amp@` entries (state names, `is_state`) never are.
  A weight no op reads has no slice; it comes from the checkpoint's
  `unread_weights.pt` (`driver/unread.py`), and a checkpoint saved before
  those were kept lacks it.
- Streaming: a checkpoint's tensors are read one at a time (`read_tensor`,
  each whole, in manifest order) and each is dropped once written; names,
  shapes and dtypes, hence every file's layout, come from the manifest
  before any tensor is read. Peak: one tensor plus, for torch, one shard.
- `hf`: transformers' own names (the record's `prefix` stripped); a tied
  tensor once, under the name of it that the model built from the config
  on the meta device (as the record's class: `architecture`) keeps
  (`named_parameters()` keeps a shared parameter's first name), or a
  persistent buffer's; a name that model does not hold (a non-persistent
  buffer) is not written, and a parameter it holds that
  the checkpoint lacks is one line. `config.json` is the record's config
  with `architectures`; the data's tokenizer travels with it when
  transformers can load it (a BPE's `tokenizer.json`, a tokenizer
  directory's files), else a note says there is none.
- `torch`: the trained module's own state names (prefix kept), every alias
  of a tied tensor the same tensor; of a transformers model only what its
  state dict holds (no non-persistent buffer), so `load_state_dict` takes
  it strictly.
- All is written into a temporary sibling of `--out`, renamed into place at
  the end: a failure leaves nothing, and an existing non-empty `--out` is
  refused (never overwritten).
"""

from __future__ import annotations

import enum
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from meshplan.data.tokenizer import BPE_FILE, EOD_TEXT, TokenizerKind
from meshplan.data.tokens import read_index
from meshplan.driver.model_record import MODEL_FILE
from meshplan.driver.train import CHECKPOINTS, complete_checkpoints
from meshplan.driver.unread import saved_unread
from meshplan.driver.weights_out import OutTensor, parse_size, write_shards
from meshplan.errors import ConfigError, MeshplanError, RuntimeFault
from meshplan.ir.fileio import staged_directory, write_atomic
from meshplan.ir.state_name import is_state
from meshplan.models.hf import meta_model
from meshplan.runtime.checkpoint import (
    COMPLETE,
    METADATA,
    file_sha256,
    read_marker,
    read_tensor,
    saved_boxes,
)

DEFAULT_SHARD_SIZE = "5GB"
# the files of a local transformers tokenizer directory that travel with it
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
                    "added_tokens.json", "spiece.model", "sentencepiece.bpe.model")


class ExportFormat(enum.StrEnum):
    """What an export is loaded by."""

    TORCH = "torch"  # torch.load + module.load_state_dict, meshplan's names
    HF = "hf"  # transformers' from_pretrained


@dataclass(frozen=True, slots=True)
class Source:
    """Weights to export: each saved tensor's (shape, dtype) by its saved
    name, a fetch of one by that name, and the record of the model."""

    where: str
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    fetch: Callable[[str], torch.Tensor]
    record: dict


@dataclass(frozen=True, slots=True)
class Exported:
    """What an export wrote."""

    out: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    seconds: float
    notes: tuple[str, ...] = ()


def find_checkpoint(path: str) -> Path:
    """The checkpoint `path` names: itself, or a run directory's newest
    complete one; one line if there is none."""
    root = Path(path)
    if not root.is_dir():
        raise RuntimeFault(f"checkpoint {path} is not a directory; give a checkpoint "
                           "(RUN/checkpoints/step_K) or a run directory")
    if (root / COMPLETE).is_file():
        return root
    if (root / CHECKPOINTS).is_dir():
        found = complete_checkpoints(root / CHECKPOINTS)
        if not found:
            raise RuntimeFault(f"run {path} has no complete checkpoint under {CHECKPOINTS}/; "
                               "train with --checkpoint-every N, or give a checkpoint")
        return found[-1]
    if (root / METADATA).is_file() or any(root.glob("*.distcp")):
        raise RuntimeFault(f"checkpoint {path} is incomplete (no {COMPLETE} marker: a run was "
                           "stopped while saving); export an earlier checkpoint")
    raise RuntimeFault(f"{path} is neither a checkpoint nor a run directory (no {COMPLETE}, "
                       f"no {CHECKPOINTS}/); give RUN/checkpoints/step_K or RUN")


def checkpoint_source(path: str) -> Source:
    """The weights of the checkpoint `path` names (see `find_checkpoint`),
    checked as the module docstring says; tensors are read on fetch."""
    root = find_checkpoint(path)
    meta = read_marker(root, "export another checkpoint")
    state, files = meta.get("state"), meta.get("files")
    if not isinstance(state, dict) or not isinstance(files, dict) or MODEL_FILE not in files:
        raise RuntimeFault(f"checkpoint {root} was saved without a model record ({MODEL_FILE} "
                           "in its marker); save it again with this meshplan")
    if file_sha256(root / METADATA) != meta.get("metadata_sha256"):
        raise RuntimeFault(f"checkpoint {root}: {METADATA} is missing or not the one saved "
                           "with it (edited or corrupted); export another checkpoint")
    record_bytes = _read(root / MODEL_FILE)
    if record_bytes is None or hashlib.sha256(record_bytes).hexdigest() != files[MODEL_FILE]:
        raise RuntimeFault(f"checkpoint {root}: {MODEL_FILE} is missing or not the one saved "
                           "with it (edited or corrupted); export another checkpoint")
    tensors = {name: (tuple(shape), _dtype(dtype, root, name))
               for name, (shape, dtype) in sorted(state.items()) if not is_state(name)}
    boxes = saved_boxes(str(root))  # the pickle, only now that its digest is checked
    # a weight no rank held (one no op reads) has no slice: it is in the
    # checkpoint's unread weights, or (saved before they were kept) nowhere
    unread = saved_unread(root, meta)
    tensors = {name: v for name, v in tensors.items() if name in boxes or name in unread}

    def fetch(name: str) -> torch.Tensor:
        shape, dtype = tensors[name]
        if name in unread:
            return unread[name].to(dtype)
        return read_tensor(str(root), name, boxes[name], shape, dtype)

    return Source(str(root), tensors, fetch, json.loads(record_bytes))


def memory_source(weights: dict[str, torch.Tensor], record: dict) -> Source:
    """The weights of a finished run (name -> whole tensor, every alias of a
    tied one the same tensor), under their saved names as a checkpoint has them."""
    others = {n for saved, names in record["aliases"].items() for n in names if n != saved}
    tensors = {name: (tuple(t.shape), t.dtype) for name, t in sorted(weights.items())
               if not is_state(name) and name not in others}
    return Source("the run's weights", tensors, weights.__getitem__, record)


def check_format(record: dict, fmt: ExportFormat, where: str) -> None:
    """One line when `fmt` cannot export the model `record` describes."""
    if fmt is ExportFormat.HF and not record.get("hf_config"):
        raise ConfigError(f"{where} is of {record.get('model', 'a model')}, not a transformers "
                          "model; use --format torch")


def check_out(out: str) -> Path:
    """`out`, if an export may be written there (new, or an empty directory)."""
    path = Path(out)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty directory; choose "
                          "a new directory")
    return path


def export(source: Source, fmt: ExportFormat, out: str,
           max_shard_size: str = DEFAULT_SHARD_SIZE) -> Exported:
    """Write `source`'s weights into the new directory `out` as `fmt`."""
    start = time.perf_counter()
    check_format(source.record, fmt, source.where)
    max_bytes = parse_size(max_shard_size)
    path = check_out(out)
    model = _meta_model(source.record) if source.record.get("hf_config") else None
    tensors = _hf_tensors(source, model) if fmt is ExportFormat.HF else \
        _torch_tensors(source, model)
    notes: list[str] = []
    with staged_directory(path) as tmp:  # check_out allowed only a new or empty one
        ext = "safetensors" if fmt is ExportFormat.HF else "pt"
        files = write_shards(tmp, tensors, source.fetch, ext, max_bytes)
        if fmt is ExportFormat.HF:
            files += _write_config(tmp, source.record, type(model).__name__)
            files += _write_tokenizer(tmp, source.record, notes)
    return Exported(str(path), tuple(files), len(tensors), sum(t.nbytes for t in tensors),
                    time.perf_counter() - start, tuple(notes))


def _torch_tensors(source: Source, model: torch.nn.Module | None) -> list[OutTensor]:
    """The tensors under the module's names; of a transformers model only the
    names its state dict holds (not a non-persistent buffer such as a rotary
    table), so `load_state_dict(strict=True)` takes the file."""
    aliases = source.record.get("aliases") or {}
    out = [OutTensor(tuple(aliases.get(key, [key])), key, shape, dtype)
           for key, (shape, dtype) in source.tensors.items()]
    if model is None:
        return out
    prefix = source.record.get("prefix", "")
    known = {prefix + n for n in model.state_dict()}
    return [t for t in out if t.names[0] in known]


def _meta_model(record: dict) -> torch.nn.Module:
    return meta_model(record["hf_config"], record.get("architecture", ""))


def _hf_tensors(source: Source, model: torch.nn.Module) -> list[OutTensor]:
    """The tensors under transformers' names (see the module docstring)."""
    params = dict(model.named_parameters())
    every_param = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    keep = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in every_param}
    keep |= {n: tuple(p.shape) for n, p in params.items()}
    prefix, aliases = source.record.get("prefix", ""), source.record.get("aliases") or {}
    out = []
    for key, (shape, dtype) in source.tensors.items():
        names = [n.removeprefix(prefix) for n in aliases.get(key, [key]) if n.startswith(prefix)]
        name = next((n for n in names if n in keep), None)
        if name is None:
            continue  # e.g. a non-persistent buffer: not part of the transformers checkpoint
        if keep[name] != shape:
            raise RuntimeFault(f"{source.where} holds '{key}' as {list(shape)}, but its config "
                               f"builds '{name}' as {list(keep[name])}: the record does not "
                               "match the weights; export with --format torch")
        out.append(OutTensor((name,), key, shape, dtype))
    written = {t.names[0] for t in out}
    missing = sorted(n for n in params if n not in written)
    if missing:
        raise RuntimeFault(f"{source.where} lacks '{missing[0]}' (and {len(missing) - 1} more) "
                           "of the transformers model its config builds; export with "
                           "--format torch")
    return out


def _write_config(tmp: Path, record: dict, architecture: str) -> list[str]:
    """The record's transformers config, with `architectures`, and with the
    data's end-of-document id as eos and bos: the token the model learned to
    end a document with, where `generate` should stop."""
    config = dict(record["hf_config"])
    config["architectures"] = [architecture]
    try:
        eod = read_index(record["data"]).get("eod") if record.get("data") else None
    except (MeshplanError, OSError):
        eod = None
    if isinstance(eod, int):
        config["eos_token_id"] = config["bos_token_id"] = eod
    write_atomic(tmp / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n")
                 .encode())
    return ["config.json"]


def _write_tokenizer(tmp: Path, record: dict, notes: list[str]) -> list[str]:
    """The data's tokenizer, as transformers loads it; a note when there is none."""
    data = record.get("data") or ""
    try:
        spec = (read_index(data).get("tokenizer") or {}) if data else {}
    except (MeshplanError, OSError):
        spec = {}
    kind = spec.get("kind")
    if kind == TokenizerKind.BPE and (Path(data) / spec.get("file", BPE_FILE)).is_file():
        write_atomic(tmp / "tokenizer.json", (Path(data) / spec.get("file", BPE_FILE))
                     .read_bytes())
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TEXT,
                  "bos_token": EOD_TEXT, "unk_token": None, "clean_up_tokenization_spaces":
                  False, "model_max_length": _positions(record["hf_config"])}
        write_atomic(tmp / "tokenizer_config.json", (json.dumps(config, indent=2) + "\n")
                     .encode())
        return ["tokenizer.json", "tokenizer_config.json"]
    if kind == TokenizerKind.PATH and Path(spec.get("path", "")).is_dir():
        found = [f for f in _TOKENIZER_FILES if (Path(spec["path"]) / f).is_file()]
        for f in found:
            write_atomic(tmp / f, (Path(spec["path"]) / f).read_bytes())
        if found:
            return found
    if kind == TokenizerKind.BYTES:
        notes.append("no tokenizer written: the model was trained on byte tokens (ids 0-255 "
                     "are UTF-8 bytes, 256 ends a document), which transformers has no "
                     "tokenizer for")
    else:
        notes.append(f"no tokenizer written: the data ({data or 'not recorded'}) has none "
                     "that transformers can load")
    return []


def _positions(config: dict) -> int:
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        if isinstance(config.get(key), int):
            return config[key]
    return 1 << 30


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _dtype(name, root: Path, tensor: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeFault(f"checkpoint {root} lists '{tensor}' with an unknown dtype "
                           f"{name!r} (damaged); export another checkpoint")
    return dtype


