"""A verb's flags from a TOML file, with `--set KEY=VALUE` overrides.

`meshplan train --config run.toml --set lr=3e-4 --steps 100`: the run's
settings come from the file, then from each `--set`, then from the flags.

Invariants:
- Every option of the verb's parser is a config key (`config_keys`), except
  the ones that say how to run the command rather than what to train (help,
  `--json`, `--config`, `--set`, `--print-config`, `--debug`, ...). A key is
  the flag's long name without its dashes, with `_` for `-` (`--global-batch-size`
  is `global_batch_size`); a file may spell it with dashes too.
- Precedence: a flag on the command line > `--set` > the file > the parser's
  default. `resolve` leaves the parser as it found it.
- A file value goes through the option's own `type`, `choices` and action,
  so a key and its flag accept the same values and give the same result.
  Tables only group keys (`[model]`, `[parallel]`): their names are ignored.
- `write_resolved` writes every key's value (None omitted: it reads back as
  the default) so that `resolve(parser, [], that_file, [])` gives the same
  value for every key.
- Every mistake (unknown key, wrong type, bad TOML, unreadable file, a `--set`
  without `=`) is one `ConfigError` line naming the key or the file, and the fix.
"""

from __future__ import annotations

import argparse
import difflib
import io
import math
import re
import tomllib
from pathlib import Path

from meshplan.errors import ConfigError
from meshplan.ir.fileio import write_atomic

# Options that say how to run the command, not what to train.
_NOT_SETTINGS = {"help", "json", "config", "set", "print_config", "debug", "verbose", "quiet"}
_BOOL_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction,
                 argparse.BooleanOptionalAction)
# Names other trainers use (Megatron, Hugging Face): an unknown key close to
# one of them is pointed at our key.
_ALIASES = {
    "learning_rate": "lr", "max_steps": "steps", "train_iters": "steps",
    "train_steps": "steps", "batch_size": "global_batch_size", "num_layers": "layers",
    "hidden_size": "hidden", "num_attention_heads": "heads", "seq_length": "seq_len",
    "vocab_size": "vocab", "tensor_model_parallel_size": "tp", "tensor_parallel": "tp",
    "pipeline_model_parallel_size": "pp", "pipeline_parallel": "pp",
    "data_parallel": "dp", "virtual_pipeline_model_parallel_size": "vpp",
    "clip_grad": "clip_grad_norm", "max_grad_norm": "clip_grad_norm",
    "lr_decay_style": "lr_schedule", "lr_warmup_iters": "warmup_steps",
    "lr_decay_iters": "decay_steps", "recompute_granularity": "recompute",
    "eval_interval": "eval_every", "eval_iters": "eval_batches", "save": "out",
}


def add_config_file_flags(p: argparse.ArgumentParser) -> None:
    """`--set KEY=VALUE` (repeatable), and `--config` reads a TOML file
    when its value ends in `.toml` (`is_config_file`)."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set lr=3e-4 (repeatable; the value "
                   "is read as TOML, else as a bare string); a flag given too wins")
    config = next((a for a in p._actions if a.dest == "config"), None)
    if config is not None:
        config.help = (f"{config.help}; or a TOML file of settings, NAME.toml (tables group "
                       "keys; key = the flag's name, e.g. global_batch_size = 16)")
    p.set_defaults(config_files=True)


def is_config_file(value: str | None) -> bool:
    """True when `--config value` names a TOML file, not a configuration name."""
    return bool(value) and str(value).lower().endswith(".toml")


def config_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every setting of `parser` by config key (see the module docstring)."""
    keys = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest == argparse.SUPPRESS:
            continue
        key = longs[0][2:].replace("-", "_")
        if key not in _NOT_SETTINGS and action.dest not in _NOT_SETTINGS:
            keys[key] = action
    return keys


def resolve(parser: argparse.ArgumentParser, argv: list[str], path: str | None,
            sets: list[str]) -> argparse.Namespace:
    """Parse `argv` with `parser`, the settings of the TOML file at `path`
    and the `--set` texts `sets` under it (precedence: flag > set > file >
    default). Options `required` by the parser may come from the file."""
    keys = config_keys(parser)
    values: dict[str, object] = {}
    if path:
        for key, value in _read_file(path, keys).items():
            values.update(_dest_value(keys[key], key, value, path))
    for text in sets:
        key, value, raw = _parse_set(text, keys)
        values.update(_dest_value(keys[key], key, value, "--set", raw))
    given = {a for a in keys.values() if a.dest in values and a.required}
    for action in given:
        action.required = False
    try:
        return parser.parse_args(argv, namespace=argparse.Namespace(**values))
    finally:
        for action in given:
            action.required = True


def _read_file(path: str, keys: dict[str, argparse.Action]) -> dict[str, object]:
    """The file's keys (tables flattened, dashes as underscores), each known."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror or err}); give the "
                          "path of a TOML file of settings") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {err.start}); save it as "
                          "UTF-8 TOML") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path}: bad TOML: {err}; fix the syntax there") from None
    flat: dict[str, object] = {}
    for name, value in _flatten(doc):
        key = name.replace("-", "_")
        if key not in keys:
            raise ConfigError(_unknown(name, f"in {path}", keys))
        if key in flat:
            raise ConfigError(f"config key '{key}' is given twice in {path}; keep one")
        flat[key] = value
    return flat


def _flatten(doc: dict):
    for name, value in doc.items():
        if isinstance(value, dict):
            yield from _flatten(value)
        else:
            yield name, value


def _unknown(name: str, where: str, keys: dict[str, argparse.Action]) -> str:
    key = name.replace("-", "_")
    known = list(keys) + [a for a, k in _ALIASES.items() if k in keys]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{_ALIASES.get(close[0], close[0])}'?" if close else \
        "the keys are the flags' names (see --help), e.g. 'global_batch_size'"
    return f"unknown config key '{name}' {where}; {hint}"


def _parse_set(text: str, keys: dict[str, argparse.Action]) -> tuple[str, object, str]:
    """`KEY=VALUE` -> (key, the value as TOML or else the bare text, the text)."""
    name, eq, raw = text.partition("=")
    if not eq or not name.strip():
        raise ConfigError(f"--set '{text}' is not KEY=VALUE; write e.g. --set lr=3e-4")
    key = name.strip().replace("-", "_")
    if key not in keys:
        raise ConfigError(_unknown(name.strip(), "in --set", keys))
    raw = raw.strip()
    try:
        value = tomllib.loads("v = " + raw)["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value, raw


def _dest_value(action: argparse.Action, key: str, value, where: str,
                raw: str | None = None) -> dict[str, object]:
    """{dest: value} for config key `key` set to `value`, as its flag would."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"config key '{key}' in {where}: {value!r} is not {expected}; "
                           f"give {_example(action, key)}")

    if isinstance(action, _BOOL_ACTIONS):
        if not isinstance(value, bool):
            raise bad("true or false")
        return {action.dest: (not value) if isinstance(action, argparse._StoreFalseAction)
                else value}
    if isinstance(action, argparse._CountAction):
        if type(value) is not int or value < 0:
            raise bad("a count (a whole number >= 0)")
        return {action.dest: value}
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        if not isinstance(value, list):
            raise bad("a list")
        return {action.dest: [_scalar(action, v, None, bad) for v in value]}
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return {action.dest: [_scalar(action, v, None, bad) for v in items]}
    return {action.dest: _scalar(action, value, raw, bad)}


def _scalar(action: argparse.Action, value, raw: str | None, bad):
    """One value through the option's `type` and `choices`."""
    kind = action.type
    if kind is None or kind is str:
        if not isinstance(value, str):
            if raw is None:  # a file: the TOML type is the user's statement
                raise bad('a string (in quotes, e.g. "text")')
            value = raw  # --set: the text as typed
        out = value
    elif kind is int:
        if type(value) is not int and not isinstance(value, str):
            raise bad("a whole number")
        out = _call(kind, value, bad, "a whole number")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise bad("a number")
        out = _call(kind, value, bad, "a number")
    else:  # a custom type function reads the flag's text
        text = value if isinstance(value, str) else raw if raw is not None else str(value)
        out = _call(kind, text, bad, "accepted by its flag")
    # the default passes, as argparse lets it (`--backend ""`: chosen at run time)
    if action.choices is not None and out not in action.choices and out != action.default:
        raise bad("one of " + ", ".join(str(c) for c in action.choices))
    return out


def _call(kind, value, bad, expected: str):
    try:
        return kind(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError, ConfigError):
        raise bad(expected) from None


def _example(action: argparse.Action, key: str) -> str:
    """A line of TOML the key accepts."""
    if isinstance(action, _BOOL_ACTIONS):
        return f"{key} = true"
    if action.choices is not None:
        return f"{key} = {_toml(list(action.choices)[0])}"
    if action.default is not None and not isinstance(action.default, list):
        return f"{key} = {_toml(action.default)}"
    sample = {int: 1, float: 0.5}.get(action.type, "text")
    return f"{key} = {_toml(sample)}"


def write_resolved(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   path: str | Path) -> None:
    """Write every config key's value in `args` to `path` as TOML (atomic),
    grouped in one table per argument group of `parser`; None is omitted."""
    keys = config_keys(parser)
    group_of = {id(a): g.title or "" for g in parser._action_groups for a in g._group_actions}
    top, tables = io.StringIO(), {}
    for key, action in keys.items():
        value = getattr(args, action.dest, None)
        if isinstance(action, argparse._StoreFalseAction) and value is not None:
            value = not value
        if value is None:
            continue
        title = group_of.get(id(action), "")
        out = top if title in ("", "options", "optional arguments", "positional arguments") \
            else tables.setdefault(_table_name(title), io.StringIO())
        out.write(f"{key} = {_toml(value)}\n")
    text = "# the resolved settings of a run: meshplan train --config THIS.toml\n"
    text += top.getvalue()
    for name, body in tables.items():
        text += f"\n[{name}]\n{body.getvalue()}"
    write_atomic(path, text.encode("utf-8"))


def _table_name(title: str) -> str:
    """An argument group's title as a bare TOML key: "parallel strategy" ->
    parallel_strategy (a remark in brackets dropped)."""
    title = re.sub(r"\(.*?\)", "", title)
    return re.sub(r"[^A-Za-z0-9_-]+", "_", title).strip("_") or "settings"


def _toml(value) -> str:
    """`value` (bool, int, float, str, or a list of them) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(float(value))
    if isinstance(value, str):
        return '"' + "".join(_char(c) for c in value) + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _char(c: str) -> str:
    """One character inside a TOML basic string."""
    if c in _ESCAPES:
        return _ESCAPES[c]
    return f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}
