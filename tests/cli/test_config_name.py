"""Configuration names: parse/format round trip, flags, bad names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshplan.cli.config_name import format_config_name, parse_config_name
from meshplan.errors import ConfigError
from tests.cli.test_cli import assert_user_error, run

SEED = "bert_nl24_nah16_hs1024_FP16_actrue_mp2_pp1_mb32_gb256_1n4g"


def test_the_seed_name_means_what_the_field_says():
    assert parse_config_name(SEED) == {
        "model": "bert", "layers": 24, "heads": 16, "hidden": 1024, "precision": "fp16",
        "recompute": "full", "tp": 2, "pp": 1, "vpp": 1, "ep": 1, "cp": 1, "zero": 0,
        "micro_batch_size": 32,
        "global_batch_size": 256, "nodes": 1, "devices_per_node": 4}


pos = st.integers(1, 4096)


@given(model=st.sampled_from(["gpt", "bert", "resnet"]), nums=st.lists(pos, min_size=9,
       max_size=9), precision=st.sampled_from(["fp32", "bf16", "fp16"]),
       recompute=st.sampled_from(["none", "full"]), vpp=st.integers(1, 8),
       ep=st.integers(1, 8), cp=st.integers(1, 8), zero=st.integers(0, 3))
def test_format_then_parse_is_identity(model, nums, precision, recompute, vpp, ep, cp, zero):
    layers, heads, hidden, tp, pp, mb, gb, nodes, dpn = nums
    f = {"model": model, "layers": layers, "heads": heads, "hidden": hidden,
         "precision": precision, "recompute": recompute, "tp": tp, "pp": pp, "vpp": vpp,
         "ep": ep, "cp": cp, "zero": zero,
         "micro_batch_size": mb, "global_batch_size": gb, "nodes": nodes,
         "devices_per_node": dpn}
    name = format_config_name(f)
    assert parse_config_name(name) == f
    assert format_config_name(parse_config_name(name)) == name


@pytest.mark.parametrize("name, field", [
    ("bert_nl24_nah16_hs1024_FP8_actrue_mp2_pp1_mb32_gb256_1n4g", "'FP8'"),
    ("bort_nl24_nah16_hs1024_FP16_actrue_mp2_pp1_mb32_gb256_1n4g", "'bort'"),
    ("bert_nlx_nah16_hs1024_FP16_actrue_mp2_pp1_mb32_gb256_1n4g", "'nlx'"),
    ("bert_nl24_nah16_hs1024_FP16_acyes_mp2_pp1_mb32_gb256_1n4g", "'acyes'"),
    ("bert_nl24_nah16_hs1024_FP16_actrue_mp0_pp1_mb32_gb256_1n4g", "'mp0'"),
    ("bert_nl24_nah16_hs1024_FP16_actrue_mp2_pp1_mb32_gb256_4g", "'4g'"),
    ("bert_nl24_nah16_hs1024_FP16_actrue_mp2_pp1_vp2_mb32_gb256_1n4g", "'vp2'"),
    ("bert_nl24_nah16_hs1024_FP16_actrue_mp2_pp1_zero4_mb32_gb256_1n4g", "'zero4'"),
    ("bert_nl24_nah16_hs1024_FP16_actrue_mp2_pp2_vpp2_zero_mb32_gb256_1n4g", "'zero'"),
    ("bert_nl24_nah16_hs1024_FP16_actrue_mp2_pp1_ep0_mb32_gb256_1n4g", "'ep0'"),
    ("bert_nl24_nah16_hs1024_FP16_actrue_mp2_pp1_ep2_zero1_zero1_mb32_gb256_1n4g",
     "'zero1' is one field too many"),
    ("bert_nl24_nah16_hs1024_FP16", "5 fields"),
])
def test_a_bad_name_points_at_the_bad_field(name, field):
    with pytest.raises(ConfigError, match=field):
        parse_config_name(name)


def test_print_config_names_the_flags():
    r = run("compile", "--model", "bert", "--devices-per-node", "4", "--tp", "2",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--recompute", "full",
            "--out", "unused", "--print-config")
    assert r.returncode == 0 and r.stdout.strip() == \
        "bert_nl4_nah4_hs64_FP32_actrue_mp2_pp1_mb4_gb8_1n4g"


def test_config_and_flags_agree_or_fail():
    name = "gpt_nl4_nah4_hs64_BF16_acfalse_mp2_pp2_vpp2_mb1_gb16_1n8g"
    r = run("plan", "--config", name, "--tp", "2", "--print-config")
    assert r.returncode == 0 and r.stdout.strip() == name
    assert_user_error(run("plan", "--config", name, "--tp", "4"), "--tp 4 contradicts")
    assert_user_error(run("run", "--config", name.replace("BF16", "FP8")), "'FP8'")
