"""TOML settings files and `--set`: precedence, spelling, errors, round trip,
and that every flag has a config key that accepts what the flag accepts."""

from __future__ import annotations

import argparse
import tomllib

import pytest

from meshplan.cli.flags import add_device_flags, add_training_flags, add_verb, apply_config
from meshplan.cli.main import _Parser
from meshplan.cli.train_config import (
    add_config_file_flags,
    config_keys,
    is_config_file,
    resolve,
    write_resolved,
)
from meshplan.errors import ConfigError


def train_parser() -> argparse.ArgumentParser:
    """A parser shaped as `meshplan train` will be: model, strategy, optimizer
    and training flags, a few train-only flags, and `--set`."""
    sub = _Parser(prog="meshplan").add_subparsers(dest="verb")
    p = add_verb(sub, "train", "train", "", run=lambda a: 0)
    add_training_flags(p, steps=10)
    add_device_flags(p)
    p.add_argument("--data", required=True, help="token directory")
    p.add_argument("--out", default="runs/x", help="run directory")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--stall-timeout", type=float, default=300.0)
    p.add_argument("--tags", nargs="+", default=None)
    add_config_file_flags(p)
    return p


@pytest.fixture
def parser():
    return train_parser()


def toml(tmp_path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_file_values_apply_through_the_flags_types(parser, tmp_path):
    path = toml(tmp_path, 'data = "tok"\nmodel = "bert"\ntp = 2\nlr = 3e-4\nzero = 1\n'
                'clip_grad_norm = 1\nauto = true\ntie_embeddings = false\ntags = ["a", "b"]\n')
    a = resolve(parser, [], path, [])
    assert (a.data, a.model, a.tp, a.lr, a.zero) == ("tok", "bert", 2, 3e-4, 1)
    assert a.clip_grad_norm == 1.0 and isinstance(a.clip_grad_norm, float)
    assert a.auto is True and a.tie_embeddings is False and a.tags == ["a", "b"]
    assert (a.pp, a.steps, a.optimizer) == (1, 10, "sgd")  # untouched: the defaults
    assert a.run is not None and a.flag_parser is parser  # set_defaults entries kept


def test_set_beats_the_file_and_a_flag_beats_both(parser, tmp_path):
    path = toml(tmp_path, 'data = "tok"\nlr = 0.1\ntp = 2\npp = 2\noptimizer = "sgd"\n')
    a = resolve(parser, ["--pp", "4"], path,
                ["lr=3e-4", "optimizer=adamw", "pp=3", "layer_stages=0,0,1,1"])
    assert (a.lr, a.optimizer, a.tp, a.pp) == (3e-4, "adamw", 2, 4)
    assert a.layer_stages == "0,0,1,1"  # not TOML: the bare text
    assert resolve(parser, ["--data", "d"], None, ["hf=1e3"]).hf == "1e3"  # a string, as typed
    assert parser.get_default("lr") is None and parser.get_default("pp") == 1  # untouched


def test_tables_are_flattened_and_dashes_or_underscores_both_work(parser, tmp_path):
    path = toml(tmp_path, '[model]\nsize = "small"\nseq-len = 64\n[parallel]\n'
                'global-batch-size = 16\nmicro_batch_size = 2\n[optimizer]\nwarmup-steps = 5\n'
                '[data]\ndata = "tok"\neval-every = 7\n')
    a = resolve(parser, [], path, ["stall-timeout=9"])
    assert (a.size, a.seq_len, a.global_batch_size, a.micro_batch_size) == ("small", 64, 16, 2)
    assert (a.warmup_steps, a.data, a.eval_every, a.stall_timeout) == (5, "tok", 7, 9.0)


def test_a_required_flag_may_come_from_the_file_but_not_from_nowhere(parser, tmp_path):
    assert resolve(parser, [], toml(tmp_path, 'data = "tok"\n'), []).data == "tok"
    with pytest.raises(ConfigError, match="--data"):
        resolve(parser, [], None, [])
    assert parser._option_string_actions["--data"].required  # restored


@pytest.mark.parametrize("text,sets,phrases", [
    ("lerning_rate = 0.1\n", [], ["'lerning_rate'", "run.toml", "did you mean 'lr'"]),
    ("[parallel]\ntensor_model_parallel = 2\n", [], ["'tensor_model_parallel'", "'tp'"]),
    ("tp = \"two\"\n", [], ["'tp'", "'two'", "a whole number", "tp = 1"]),
    ("tp = 2.0\n", [], ["'tp'", "a whole number"]),
    ("lr = \"fast\"\n", [], ["'lr'", "'fast'", "a number"]),
    ("optimizer = \"adam\"\n", [], ["'optimizer'", "'adam'", "one of sgd, adamw"]),
    ("zero = 4\n", [], ["'zero'", "one of 0, 1, 2, 3"]),
    ("auto = 1\n", [], ["'auto'", "true or false"]),
    ("model = 3\n", [], ["'model'", "a string"]),
    ("tags = \"a\"\n", [], ["'tags'", "a list"]),
    ("tp = 2\ntp-plan = \"derived\"\n[x]\ntp = 3\n", [], ["'tp'", "twice"]),
    ("tp = = 2\n", [], ["run.toml", "line 2", "bad TOML"]),
    ("", ["lr"], ["--set 'lr'", "KEY=VALUE"]),
    ("", ["lerning_rate=3"], ["'lerning_rate'", "--set", "'lr'"]),
    ("", ["tp=x"], ["'tp'", "--set", "a whole number"]),
])
def test_each_mistake_is_one_config_error_line(parser, tmp_path, text, sets, phrases):
    path = toml(tmp_path, 'data = "tok"\n' + text)
    with pytest.raises(ConfigError) as err:
        resolve(parser, [], path, sets)
    message = str(err.value)
    assert "\n" not in message
    for phrase in phrases:
        assert phrase in message, (phrase, message)


def test_an_unreadable_file_is_one_line(parser, tmp_path):
    with pytest.raises(ConfigError, match=r"--config .*missing\.toml: cannot read it"):
        resolve(parser, [], str(tmp_path / "missing.toml"), [])
    (tmp_path / "bin.toml").write_bytes(b"lr = \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        resolve(parser, [], str(tmp_path / "bin.toml"), [])


def test_write_resolved_reads_back_the_same_for_every_key(parser, tmp_path):
    argv = ["--data", 'to"k\\ens\n\tü', "--model", "bert", "--size", "small", "--tp", "2",
            "--pp", "2", "--vpp", "2", "--lr", "3e-4", "--optimizer", "adamw", "--zero", "1",
            "--no-tie-embeddings", "--auto", "--bucket-mb", "0.1", "--stall-timeout", "inf",
            "--tags", "a", "b c", "--layer-stages", "0,0,1,1", "--no-decay", ""]
    a = resolve(parser, argv, None, [])
    path = tmp_path / "resolved.toml"
    write_resolved(parser, a, path)
    doc = tomllib.loads(path.read_text())  # valid TOML, grouped in tables
    assert doc["model"]["model"] == "bert" and doc["parallel_strategy"]["tp"] == 2
    back = resolve(parser, [], str(path), [])
    for key, action in config_keys(parser).items():
        assert getattr(back, action.dest) == getattr(a, action.dest), key
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temp file


def _sample(action: argparse.Action):
    """A value for `action` that is not its default: (TOML value, flag tokens)."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return True, [flag]
    if isinstance(action, argparse._StoreTrueAction):
        return True, [flag]
    if action.choices is not None:
        value = [c for c in action.choices if c != action.default][-1]
        return value, [flag, str(value)]
    if action.nargs == "+":
        return ["p", "q"], [flag, "p", "q"]
    value = {int: 3, float: 0.25}.get(action.type, "x1")
    if value == action.default:  # e.g. --keep 3
        value = {int: 4, float: 0.5}.get(action.type, "x2")
    return value, [flag, str(value)]


def test_every_flag_is_a_config_key_and_the_two_agree(parser, tmp_path):
    keys = config_keys(parser)
    settings = [a for a in parser._actions if a.option_strings and a.dest not in
                ("help", "json", "config", "set", "print_config")]
    assert {id(a) for a in settings} == {id(a) for a in keys.values()}
    assert {"global_batch_size", "tie_embeddings", "lr", "data", "eval_every"} <= set(keys)
    assert not {"help", "json", "config", "set", "print_config", "run"} & set(keys)
    for key, action in keys.items():
        value, tokens = _sample(action)
        base = [] if key == "data" else ["--data", "d"]
        by_flag = resolve(parser, base + tokens, None, [])
        by_file = resolve(parser, base, toml(tmp_path, f"{key} = {_lit(value)}\n"), [])
        assert getattr(by_flag, action.dest) == getattr(by_file, action.dest), key
        assert getattr(by_flag, action.dest) != action.default, key


def _lit(value) -> str:
    from meshplan.cli.train_config import _toml

    return _toml(value)


def test_is_config_file_and_other_verbs_refuse_a_toml_config(parser):
    assert is_config_file("run.toml") and is_config_file("dir/RUN.TOML")
    assert not is_config_file("gpt_nl4_nah4_hs64_FP32_actrue_mp2_pp1_mb4_gb8_1n4g")
    assert not is_config_file(None)
    a = resolve(parser, ["--data", "d", "--config", "run.toml"], None, [])
    apply_config(a)  # train reads files: nothing to do here
    assert "TOML file" in parser._option_string_actions["--config"].help
    a.config_files = False
    with pytest.raises(ConfigError, match="not a TOML file"):
        apply_config(a)


def real_train_parser() -> argparse.ArgumentParser:
    """The `meshplan train` verb's own parser."""
    from meshplan.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def test_the_train_verbs_every_flag_is_a_config_key_and_the_two_agree(tmp_path):
    test_every_flag_is_a_config_key_and_the_two_agree(real_train_parser(), tmp_path)


def test_the_train_verbs_resolved_config_reads_back_the_same(tmp_path):
    parser = real_train_parser()
    a = resolve(parser, ["--data", "d", "--tp", "1", "--lr", "1e-4", "--module", "m:f"], None,
                [])
    path = tmp_path / "config.toml"
    write_resolved(parser, a, path)
    back = resolve(parser, [], str(path), [])
    for key, action in config_keys(parser).items():
        assert getattr(back, action.dest) == getattr(a, action.dest), key
    assert (back.steps, back.size, back.tp, back.lr) == (160, "small", 1, 1e-4)  # main job's
