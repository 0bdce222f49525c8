"""Configuration names: the field's one-word description of a training run.

    bert_nl24_nah16_hs1024_FP16_actrue_mp2_pp1_mb32_gb256_1n4g

is BERT with 24 layers, 16 heads, hidden 1024, in fp16, with activation
checkpointing, tensor parallel 2, pipeline parallel 1, micro-batch 32,
global batch 256, on 1 node of 4 devices. An optional `_vpp{v}` follows
`pp`, then an optional `_ep{e}` (expert parallel), an optional `_cp{c}`
(context parallel), then an optional `_zero{z}` (sharded data parallel,
ZeRO stage 1-3).
The grammar, field by field (`_` separates fields):

    {model} nl{L} nah{H} hs{D} {FP16|BF16|FP32} ac{true|false}
    mp{tp} pp{pp} [vpp{v}] [ep{e}] [cp{c}] [zero{z}] mb{micro} gb{global} {N}n{G}g

Invariant: `format_config_name(parse_config_name(s)) == s` for every valid
`s`, and a bad name raises `ConfigError` naming the first bad field.
"""

from __future__ import annotations

import re

from meshplan.errors import ConfigError
from meshplan.ir.choices import Precision, Recompute
from meshplan.ir.zero import ZeroLevel

PRECISIONS = {p.value.upper(): p for p in Precision}  # FP32 -> fp32, ...
GRAMMAR = ("{model}_nl{L}_nah{H}_hs{D}_{FP16|BF16|FP32}_ac{true|false}_mp{tp}_pp{pp}"
           "[_vpp{v}][_ep{e}][_cp{c}][_zero{z}]_mb{micro}_gb{global}_{N}n{G}g")
EXAMPLE = "bert_nl24_nah16_hs1024_FP16_actrue_mp2_pp1_mb32_gb256_1n4g"

# (flag name, field prefix, what it means), in name order after the model
_INT_FIELDS = (("layers", "nl", "layers"), ("heads", "nah", "attention heads"),
               ("hidden", "hs", "hidden size"))
_PARALLEL = (("tp", "mp", "tensor parallel"), ("pp", "pp", "pipeline parallel"))
_OPTIONAL = (("vpp", "vpp", "virtual stages per stage"), ("ep", "ep", "expert parallel"),
             ("cp", "cp", "context parallel"))
_BATCH = (("micro_batch_size", "mb", "micro-batch size"),
          ("global_batch_size", "gb", "global batch size"))


def _bad(name: str, field: str, why: str) -> ConfigError:
    return ConfigError(f"config name '{name}': field '{field}' {why}; names look like "
                       f"{GRAMMAR}, e.g. {EXAMPLE}")


def _int(name: str, field: str, prefix: str, what: str) -> int:
    m = re.fullmatch(re.escape(prefix) + r"([0-9]+)", field)
    if not m:
        raise _bad(name, field, f"should be {prefix}<{what}>, e.g. {prefix}4")
    value = int(m.group(1))
    if value < 1:
        raise _bad(name, field, f"gives {what} {value}; it must be at least 1")
    return value


def _zero(name: str, field: str) -> ZeroLevel:
    level = _int(name, field, "zero", "ZeRO stage")
    try:
        return ZeroLevel(level)
    except ValueError:
        *sharded, last = (f"zero{z}" for z in ZeroLevel if z is not ZeroLevel.NONE)
        raise _bad(name, field, f"is not a ZeRO stage; use {', '.join(sharded)} or {last}") \
            from None


def parse_config_name(name: str, models: tuple[str, ...] = ("gpt", "bert", "resnet")) -> dict:
    """The flag values a configuration name stands for (flag dest -> value)."""
    fields = name.strip().split("_")
    if len(fields) not in range(11, 16):
        raise ConfigError(f"config name '{name}' has {len(fields)} fields separated by '_'; "
                          f"it needs 11 (one more each with vpp, ep, cp and zero): {GRAMMAR}, "
                          f"e.g. {EXAMPLE}")
    it = iter(fields)
    model = next(it)
    if model not in models:
        raise _bad(name, model, f"is not a model; use one of {', '.join(models)}")
    out: dict = {"model": model}
    for dest, prefix, what in _INT_FIELDS:
        out[dest] = _int(name, next(it), prefix, what)
    precision = next(it)
    if precision not in PRECISIONS:
        raise _bad(name, precision, "should be FP32, BF16 or FP16")
    out["precision"] = PRECISIONS[precision]
    ac = next(it)
    if ac not in ("actrue", "acfalse"):
        raise _bad(name, ac, "should be actrue or acfalse (activation checkpointing)")
    out["recompute"] = Recompute.FULL if ac == "actrue" else Recompute.NONE
    for dest, prefix, what in _PARALLEL:
        out[dest] = _int(name, next(it), prefix, what)
    field = next(it)
    optional = len(fields) - 11
    out["vpp"], out["ep"], out["cp"], out["zero"] = 1, 1, 1, ZeroLevel.NONE
    for dest, prefix, what in _OPTIONAL:
        if optional and re.fullmatch(prefix + r"[0-9]+", field):
            out[dest] = _int(name, field, prefix, what)
            field, optional = next(it), optional - 1
    if optional:
        out["zero"] = _zero(name, field)
        field, optional = next(it), optional - 1
    if optional:
        raise _bad(name, field, "is one field too many; the optional fields are vpp, ep, cp "
                   "and zero, in that order")
    for (dest, prefix, what), f in zip(_BATCH, (field, next(it))):
        out[dest] = _int(name, f, prefix, what)
    devices = next(it)
    m = re.fullmatch(r"([0-9]+)n([0-9]+)g", devices)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise _bad(name, devices, "should be <nodes>n<devices per node>g, e.g. 1n4g")
    out["nodes"], out["devices_per_node"] = int(m.group(1)), int(m.group(2))
    return out


def format_config_name(f: dict) -> str:
    """The configuration name of flag values (the inverse of `parse_config_name`)."""
    inv = {v: k for k, v in PRECISIONS.items()}
    parts = [f["model"], *(f"{p}{f[d]}" for d, p, _ in _INT_FIELDS), inv[f["precision"]],
             "actrue" if f["recompute"] != Recompute.NONE else "acfalse",
             *(f"{p}{f[d]}" for d, p, _ in _PARALLEL)]
    parts += [f"{p}{f[d]}" for d, p, _ in _OPTIONAL if f.get(d, 1) > 1]
    if ZeroLevel(f.get("zero", ZeroLevel.NONE)) is not ZeroLevel.NONE:
        parts.append(f"zero{f['zero']}")
    parts += [f"{p}{f[d]}" for d, p, _ in _BATCH]
    parts.append(f"{f['nodes']}n{f['devices_per_node']}g")
    return "_".join(parts)
