"""Device models by name: the built-in JSON files and this machine's own.

Invariants:
- Built-in models are package data, `meshplan/costmodel/devices/<name>.json`;
  `cpu-local` is the file `meshplan calibrate` writes,
  `$MESHPLAN_HOME/devices/cpu-local.json` (`MESHPLAN_HOME` defaults to
  `~/.cache/meshplan`).
- File form (one JSON object): `name`; `flops`, a map dtype -> rate; `mem_bw`,
  `intra_bw`, `inter_bw` rates; `intra_latency`, `inter_latency` seconds;
  `memory_bytes`, `devices_per_node` integers; `sources`, a list of
  strings; optionally `kernel_overhead` (s added to every kernel, its
  launch and dispatch), `p2p_latency`, `p2p_bw` (point-to-point within a
  node, when unlike the collectives'), `host_cores` (the CPU cores a node's
  ranks share, for processes on one host; see `DeviceModel`). A rate is a
  number (bytes/s or FLOP/s) or `{"peak": P, "efficiency": E}`, meaning P * E, so a file states the
  datasheet figure and the measured fraction apart. `peak_flops` per dtype
  is the `peak` of each flops entry (or an explicit `peak_flops` map). Any
  other key (`notes`, `measured`) is for people and ignored here.
- Every user mistake (an unknown name, a malformed file) is one
  `ConfigError` line: what, where, how to fix it.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from meshplan.costmodel.device import DTYPES, DeviceModel
from meshplan.errors import ConfigError

LOCAL = "cpu-local"  # the model `meshplan calibrate` measures on this machine
_RATES = ("mem_bw", "intra_bw", "inter_bw")
_SECONDS = ("intra_latency", "inter_latency")
_COUNTS = ("memory_bytes", "devices_per_node")


def meshplan_home() -> Path:
    """`$MESHPLAN_HOME`, else `~/.cache/meshplan`."""
    env = os.environ.get("MESHPLAN_HOME")
    return Path(env) if env else Path.home() / ".cache" / "meshplan"


def local_model_path() -> Path:
    """Where `meshplan calibrate` writes, and `load_device_model("cpu-local")` reads."""
    return meshplan_home() / "devices" / f"{LOCAL}.json"


def _builtin_dir():
    return resources.files("meshplan.costmodel").joinpath("devices")


def builtin_device_models() -> tuple[str, ...]:
    """The names of the device models shipped with meshplan."""
    return tuple(sorted(p.name.removesuffix(".json") for p in _builtin_dir().iterdir()
                        if p.name.endswith(".json")))


def known_device_models() -> tuple[str, ...]:
    """Every name `load_device_model` accepts (cpu-local once calibrated)."""
    return builtin_device_models() + (LOCAL,)


def load_device_model(name: str) -> DeviceModel:
    """The device model called `name`: a built-in one, or `cpu-local`."""
    if name == LOCAL:
        path = local_model_path()
        if not path.is_file():
            raise ConfigError(f"device model '{LOCAL}' has not been measured on this machine "
                              f"(no {path}); run `meshplan calibrate` to make it")
        return parse_device_model(path.read_text(), str(path))
    if name not in builtin_device_models():
        raise ConfigError(f"unknown device model '{name}'; known: "
                          f"{', '.join(known_device_models())} (run `meshplan calibrate` "
                          f"to make {LOCAL}, this machine's own)")
    source = _builtin_dir().joinpath(f"{name}.json")
    return parse_device_model(source.read_text(), f"meshplan/costmodel/devices/{name}.json")


def parse_device_model(text: str, where: str) -> DeviceModel:
    """A `DeviceModel` from a file's text (the form in the module docstring)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not JSON ({e.msg}, line {e.lineno}); fix the file, "
                          "or run `meshplan calibrate` again for cpu-local") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} holds no JSON object; see docs/concepts/device_models.md")
    missing = [k for k in ("name", "flops", *_RATES, *_SECONDS, *_COUNTS) if k not in data]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}; see "
                          "docs/concepts/device_models.md for the fields")
    flops_in = data["flops"]
    if not isinstance(flops_in, dict) or "float32" not in flops_in:
        raise ConfigError(f"{where}: 'flops' must map dtype names ({', '.join(DTYPES)}) to "
                          "rates, float32 at least")
    peaks_in = data.get("peak_flops", {})
    flops, peaks = [], []
    for dtype, entry in flops_in.items():
        flops.append((dtype, _rate(entry, f"{where}: flops.{dtype}")))
        peak = peaks_in.get(dtype, entry["peak"] if isinstance(entry, dict) else entry)
        peaks.append((dtype, _positive(peak, f"{where}: peak of flops.{dtype}")))
    return DeviceModel(
        name=str(data["name"]), flops=tuple(flops), peak_flops=tuple(peaks),
        mem_bw=_rate(data["mem_bw"], f"{where}: mem_bw"),
        memory_bytes=int(_positive(data["memory_bytes"], f"{where}: memory_bytes")),
        devices_per_node=int(_positive(data["devices_per_node"],
                                       f"{where}: devices_per_node")),
        intra_bw=_rate(data["intra_bw"], f"{where}: intra_bw"),
        intra_latency=_non_negative(data["intra_latency"], f"{where}: intra_latency"),
        inter_bw=_rate(data["inter_bw"], f"{where}: inter_bw"),
        inter_latency=_non_negative(data["inter_latency"], f"{where}: inter_latency"),
        sources=tuple(str(s) for s in data.get("sources", ())),
        p2p_latency=_optional(data, "p2p_latency", _non_negative, where),
        p2p_bw=_optional(data, "p2p_bw", _rate, where),
        kernel_overhead=_optional(data, "kernel_overhead", _non_negative, where) or 0.0,
        host_cores=int(_optional(data, "host_cores", _positive, where) or 0))


def _optional(data: dict, key: str, check, where: str) -> float | None:
    return None if data.get(key) is None else check(data[key], f"{where}: {key}")


def _rate(entry, what: str) -> float:
    if isinstance(entry, dict):
        if set(entry) - {"peak", "efficiency", "note"} or "peak" not in entry:
            raise ConfigError(f"{what} must be a number or {{\"peak\": P, \"efficiency\": E}}")
        eff = _positive(entry.get("efficiency", 1.0), f"{what}.efficiency")
        if eff > 1:
            raise ConfigError(f"{what}.efficiency {eff} is above 1; give a fraction of the peak")
        return _positive(entry["peak"], f"{what}.peak") * eff
    return _positive(entry, what)


def _positive(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
        raise ConfigError(f"{what} is {x!r}; it must be a positive number")
    return float(x)


def _non_negative(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0:
        raise ConfigError(f"{what} is {x!r}; it must be a number >= 0")
    return float(x)


def device_model_json(model: DeviceModel, extra: dict | None = None) -> str:
    """`model` in the file form (rates as plain numbers), plus `extra` keys."""
    data = {
        "name": model.name,
        "flops": dict(model.flops), "peak_flops": dict(model.peak_flops),
        "mem_bw": model.mem_bw, "memory_bytes": model.memory_bytes,
        "devices_per_node": model.devices_per_node,
        "intra_bw": model.intra_bw, "intra_latency": model.intra_latency,
        "inter_bw": model.inter_bw, "inter_latency": model.inter_latency,
        "sources": list(model.sources),
    }
    for key in ("p2p_latency", "p2p_bw"):
        if getattr(model, key) is not None:
            data[key] = getattr(model, key)
    if model.kernel_overhead:
        data["kernel_overhead"] = model.kernel_overhead
    if model.host_cores:
        data["host_cores"] = model.host_cores
    return json.dumps(data | (extra or {}), indent=2) + "\n"
