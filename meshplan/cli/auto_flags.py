"""The `--auto` flags (the strategy search) and their byte sizes.

Invariants:
- `add_auto_flags` is the one definition of --auto, --device-model and
  --memory-per-device; `cli/flags.py` adds them to every planning verb and
  `cli/auto_cmd.py` reads them (this module imports neither: no circle).
- `parse_bytes` turns a size with a unit into bytes; a bad size is one
  ConfigError line.
"""

from __future__ import annotations

import re

from meshplan.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def add_auto_flags(g) -> None:
    g.add_argument("--auto", action="store_true",
                   help="search dp, tp, pp, vpp, schedule, micro-batch, recompute and ZeRO for "
                   "the fastest simulated step that fits --memory-per-device (plan --auto "
                   "prints the top 10; compile, run and verify use the winner)")
    g.add_argument("--device-model", default=None, metavar="NAME",
                   help="the device model --auto prices on: a100-80gb, h100-80gb, h200-141gb, "
                   "or cpu-local (`meshplan calibrate`); default cpu-local")
    g.add_argument("--memory-per-device", default=None, metavar="BYTES",
                   help="--auto's memory limit per device, e.g. 80GB, 64GiB or 1e9 "
                   "(default: the device model's memory)")


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    try:
        value = float(m.group(1)) if m else -1.0
    except ValueError:
        value = -1.0
    if not m or unit not in _UNITS or value <= 0:
        raise ConfigError(f"--memory-per-device '{text}' is not a size; give bytes or a number "
                          "with a unit, e.g. 80GB, 64GiB or 8e10")
    return int(value * _UNITS[unit])
