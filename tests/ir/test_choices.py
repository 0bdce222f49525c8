"""Named choices (ir/choices.py) and state names (ir/state_name.py)."""

import dataclasses
import json

import pytest

from meshplan.autodiff import OptimizerConfig
from meshplan.errors import ConfigError
from meshplan.ir.choices import Precision, TpStyle
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.ir.state_name import StateName, is_state
from meshplan.passes.strategy import check_strategy


@pytest.mark.parametrize("build, message", [
    # a schedule is a registry record (schedules/registry.py), checked with the strategy
    (lambda: check_strategy(Mesh(), Strategy(schedule="zigzag")),
     "unknown schedule 'zigzag': choose one of 1f1b, interleaved, zb1p, zbv, gpipe, csv"),
    (lambda: Strategy(precision="fp8"),
     "unknown precision 'fp8': choose one of fp32, bf16, fp16"),
    (lambda: Strategy(recompute="some"),
     "unknown recompute mode 'some': choose one of none, full, selective"),
    (lambda: Strategy(tp_plan=((r"blocks\.0", "diagonal"),)),
     r"unknown tensor-parallel style 'diagonal' for 'blocks\.0': choose one of colwise, "
     "rowwise, vocab, replicate"),
    (lambda: OptimizerConfig("lamb"), "unknown optimizer 'lamb': choose one of sgd, adamw"),
])
def test_a_bad_name_is_one_config_error_line(build, message):
    with pytest.raises(ConfigError) as info:
        build()
    assert str(info.value) == message


def test_names_become_members_that_encode_as_the_same_strings():
    s = Strategy(schedule="gpipe", precision="bf16", tp_plan=(("wte", "vocab"),))
    assert s.schedule == "gpipe" and s.precision is Precision.BF16
    assert s.tp_plan == (("wte", TpStyle.VOCAB),) and s.tp_plan[0][1] is TpStyle.VOCAB
    plain = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    as_strings = plain | {"schedule": "gpipe", "precision": "bf16", "recompute": "none",
                          "tp_plan": (("wte", "vocab"),)}
    assert json.dumps(dataclasses.asdict(s)) == json.dumps(as_strings)


@pytest.mark.parametrize("name", ["wte.weight@exp_avg", "blocks.0.attn.qkv.bias@grad",
                                  "amp@loss_scale", "a@b@step"])
def test_state_names_round_trip(name):
    parsed = StateName.parse(name)
    assert str(parsed) == name and is_state(name)
    assert StateName(parsed.fqn, parsed.slot) == parsed


def test_state_name_parts():
    assert StateName.parse("blocks.0.mlp.fc1.weight@exp_avg_sq") == \
        StateName("blocks.0.mlp.fc1.weight", "exp_avg_sq")
    assert str(StateName.grad("wte.weight")) == "wte.weight@grad"
    assert not is_state("wte.weight")
