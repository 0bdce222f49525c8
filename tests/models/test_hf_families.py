"""The wide test of transformers families (issue 34): one tiny model per
type of `models.hf.TESTED`, built offline from its config, trains 2 SGD
steps at 1 rank equal to eager (losses, every parameter and optimizer slot:
driver.verify's verdict); the types of `SPLIT_TESTED` also at tp2*pp2
(albert, whose layers share one group of weights, at tp2 alone), and two
encoder-decoders at pp4, where the encoder's output skips a stage. The
README's list of tested types is this list (checked below)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from meshplan.autodiff import OptimizerConfig  # noqa: E402
from meshplan.driver.plan import plan_model, zoo_strategy  # noqa: E402
from meshplan.driver.verify import against_eager  # noqa: E402
from meshplan.ir.kinds import ALL_GATHER  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.models import build_model, example_batch, model_config  # noqa: E402
from meshplan.models.hf import SPLIT_TESTED, TESTED, attention_of  # noqa: E402
from meshplan.runtime.local import run_local  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LAYOUTS = {"1rank": (1, {}), "tp2": (2, dict(tp=2, micro_batch_size=4)),
           "tp2pp2": (4, dict(tp=2, pp=2, micro_batch_size=2)),
           "pp4": (4, dict(pp=4, micro_batch_size=2)),
           "tp2pp2vpp2": (4, dict(tp=2, pp=2, vpp=2, micro_batch_size=2)),
           "dp2": (2, dict(dp=2, micro_batch_size=2)),
           "dp2-zero1": (2, dict(dp=2, micro_batch_size=2, zero=1))}
STEPS = 2


def train(model_type: str, layout: str, optimizer: str = "sgd"):
    world, fields = LAYOUTS[layout]
    model = f"hf:{model_type}"
    cfg = model_config(model, "tiny")
    s = zoo_strategy(model, cfg, global_batch_size=8, **fields)
    job = plan_model(model, "tiny", Mesh(1, world), s, optimizer, None).job
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, 8, seed=i) for i in range(STEPS)]
    run = run_local(job, copy.deepcopy(module), batches)
    verdict, _ = against_eager(run.rank_losses, run.slices, module, batches,
                               s.num_microbatches, OptimizerConfig.default(optimizer, None))
    return job, verdict, cfg


# T5 at one rank with one sample per micro-batch: verify's twin (each
# micro-batch's samples reversed) is then the run itself, so no rounding noise
# is measured, and on an AMD EPYC CPU (not on the CPUs before it) T5's step-2
# momentum buffers differ from eager's by up to 1.4e-5 against a 1.01e-5
# bound, every slot within 2e-8 after step 1, the losses bit-equal: rounding
# amplified, which the twin cannot see. With 2 samples per micro-batch it is
# measured (and passes).
ONE_RANK = {"t5": "1rank-mb2"}
LAYOUTS["1rank-mb2"] = (1, dict(micro_batch_size=2))
CASES = [pytest.param(t, ONE_RANK.get(t, "1rank"), id=f"{t}-1rank") for t in TESTED] + [
    pytest.param(t, "tp2" if t == "albert" else "tp2pp2", id=f"{t}-split")
    for t in SPLIT_TESTED] + [
    # the encoder's output (and masks) go from stage 1 to both decoder stages, 2 and 3:
    # one stage sending a micro-batch to two (the executor once sent both at the first)
    pytest.param(t, "pp4", id=f"{t}-pp4") for t in ("bart", "t5")] + [
    # a grad_sum's share of a gradient from another stage (`local_partial` after a
    # transfer): the main job's layout once stopped planning these on an assert
    pytest.param(t, "tp2pp2vpp2", id=f"{t}-tp2pp2vpp2") for t in ("bart", "t5")] + [
    # ops that once gathered dp's batch whole (ESM's type_as and erf, Mamba's
    # scan of selects, BLOOM's alibi baddbmm): the batch stays split
    pytest.param(t, "dp2", id=f"{t}-dp2") for t in ("esm", "mamba", "bloom")]


def verifies_equal(capsys, *args: str) -> None:
    """`meshplan verify ARGS --json` exits 0 with the verdict equal."""
    from meshplan.cli.main import main

    code = main(["verify", *args, "--json"])
    out = capsys.readouterr().out
    assert code == 0 and '"ok": true' in out, out[-2000:]


@pytest.mark.parametrize("model_type, layout", CASES)
def test_family_trains_as_eager(model_type, layout):
    job, verdict, cfg = train(model_type, layout)
    assert verdict["ok"], verdict["problems"]
    assert verdict["max_abs_diff"] <= 1e-5
    assert verdict["params"] and all(d["ok"] for d in verdict["params"].values())
    if layout == "dp2":
        assert not [op.module_path for op in job.graph.ops if op.kind == ALL_GATHER]
    if attention_of(cfg) == "eager":  # bloom: no SDPA kernel in transformers
        assert any("eager implementation" in n for n in job.notes), job.notes


def test_split_types_are_tested_types():
    assert set(SPLIT_TESTED) <= set(TESTED) and len(set(TESTED)) >= 25


def test_readme_lists_the_tested_types():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    m = re.search(r"<!-- hf-tested -->(.*?)<!-- /hf-tested -->", readme, re.S)
    assert m, "README.md lacks its <!-- hf-tested --> list"
    assert re.findall(r"`([\w-]+)`", m.group(1)) == list(TESTED)


def not_language_models() -> list[str]:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as m

    lm = (set(m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(m.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
          | set(m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES))
    return sorted(set(CONFIG_MAPPING.keys()) - lm)


def test_every_other_type_is_refused_in_one_line():
    """A vision, audio or retrieval model_type is refused with one line
    (ConfigError), never a traceback; the language models are surveyed
    (benchmarks/hf_survey.py)."""
    from meshplan.errors import ConfigError

    others = not_language_models()
    assert len(others) > 100
    for t in others:
        with pytest.raises(ConfigError) as e:
            build_model(model_config(f"hf:{t}", "tiny"), device="meta")
        assert "\n" not in str(e.value) and f"hf:{t}" in str(e.value), (t, str(e.value))


def test_planted_a_whole_contribution_on_every_rank_trains_electra_wrong(monkeypatch):
    """ELECTRA at tp2·pp2: its embedding's gradient accumulator is Partial over
    tp and takes a whole contribution, which each rank's share must sum to
    (`runtime/bind._share_of_sum`). Planted: every rank keeps it whole."""
    from meshplan.runtime import bind

    monkeypatch.setattr(bind, "_share_of_sum", lambda ctx, axis: lambda x, **_: x)
    _, verdict, _ = train("electra", "tp2pp2")
    assert not verdict["ok"]


def test_planted_export_alone_trains_yoso_wrong(monkeypatch, tmp_path):
    """YOSO's attention is a `torch.autograd.Function` with a backward of its
    own, which capture keeps whole (`capture/functions.py`). Planted: traced
    through, as by export alone, the forward's derivative trains instead."""
    from contextlib import nullcontext

    from meshplan.capture import torch_export

    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path))  # a capture of its own
    monkeypatch.setattr(torch_export, "kept_whole", nullcontext)
    _, verdict, _ = train("yoso", "1rank")
    assert not verdict["ok"]


def test_zero1_adamw_makes_its_own_parameter_shard():
    """Omni-ASR at dp2, ZeRO-1 AdamW: its backward slices a parameter to dp's
    shard, the shard the step's AdamW reads too. Boxing once handed the step
    the backward's slice, gone by the time the step runs: every rank crashed
    (KeyError). The step now makes its own (passes/boxing.py)."""
    _, verdict, _ = train("omniasr", "dp2-zero1", "adamw")
    assert verdict["ok"], verdict["problems"]
    assert any(name.endswith("@exp_avg") for name in verdict["optimizer_state"])


def test_deepseek_v2_trains_under_bf16_as_eager_autocast(capsys):
    """Its rotary takes `xq.float()` before `view_as_complex`; the fp32
    capture drops that cast (it changes nothing there), so bf16 planning
    once asked for the complex view of a bf16 tensor, which torch refuses:
    `view_as_complex` computes in fp32 (`ops/policy.py`)."""
    verifies_equal(capsys, "--hf", "deepseek_v2", "--precision", "bf16", "--steps", "2")


def test_phimoe_at_dp2_tp2_zero2_adamw_is_judged_not_called_chaotic(capsys):
    """PhiMoE draws its routing's noise over the batch's tokens, flattened
    (`uniform_` on (tokens, experts)). verify's twin reverses each
    micro-batch's samples, and drew those numbers in the old order: another
    routing, its loss 1.5e-3 away, and the run (losses bit-equal) refused as
    chaotic. The twin's draws now follow its samples (`same_masks._rows`)."""
    verifies_equal(capsys, "--hf", "phimoe", "--steps", "2", "--devices-per-node", "4",
                   "--dp", "2", "--tp", "2", "--zero", "2", "--optimizer", "adamw")


def test_ctrl_at_cp2_is_judged_equal_where_a_relu_fell_the_other_way(capsys):
    """CTRL tiny (seed 2) at cp2: one ReLU input 3.6e-8 from 0 fell on the
    other side of the kink (on this machine's rounding), a momentum row 2%
    off, the losses bit-equal; judged equal with the kink noise
    (`driver/kinks.py`; its planted test is tests/driver/test_kinks.py)."""
    verifies_equal(capsys, "--hf", "ctrl", "--steps", "1", "--devices-per-node", "2",
                   "--cp", "2", "--seed", "2")


@pytest.mark.parametrize("model_type, layout", [("qwen2", "--tp"), ("blenderbot-small", "--dp")])
def test_bf16_adamw_judges_a_key_bias_by_autocasts_own_error(model_type, layout, capsys):
    """bf16 AdamW at 2 ranks. BlenderBot-Small's separate `k_proj.bias` has a
    gradient of zero in exact arithmetic, all rounding, so Adam's steps on it
    are rounding's coin tosses: quiet where fp32's gradient is 100x smaller
    (`compare.adam_flips`'s `wide`). Qwen2's (rotated with its keys) is not
    zero but mostly rounding: judged by autocast's own distance from fp32
    (`verify.judge`'s second chance). Both were refused, losses 2e-5 apart."""
    verifies_equal(capsys, "--hf", model_type, "--steps", "2", "--devices-per-node", "2",
                   layout, "2", "--precision", "bf16", "--optimizer", "adamw")


@pytest.mark.parametrize("model_type", ["fnet", "pegasus_x", "yoso"])
def test_trains_under_bf16_as_autocast_computes(model_type, capsys):
    """Refused under bf16 until the precision table (`ops/policy.py`) said
    what autocast does: no FFT kernel takes bf16, and FNet's token mixing
    (`fft_fftn`) computes in fp32; PEGASUS-X's `einsum` of a bf16 and an fp32
    tensor computes in bf16, as its bmm does under autocast ('expected
    scalar type torch.float32 but found torch.bfloat16'). YOSO's kept-whole
    `autograd.Function` mixes bf16 and fp32 as autocast lets it: its op
    applies it, forward and backward, under the autocast it was captured in
    (`ops/function_op.py`)."""
    verifies_equal(capsys, "--hf", model_type, "--precision", "bf16", "--steps", "2")


def test_a_moe_router_under_bf16_adamw_is_judged_by_autocasts_own_error(capsys):
    """Llama 4's router at one rank, bf16 AdamW: eager autocast's update is
    18% off fp32's, the run's 30-40% off eager's (a router's gradient is
    mostly rounding in bf16), refused by the 25% update bound; within 4x
    eager's own, as every noise (`compare.compare_state`'s `own_update`)."""
    verifies_equal(capsys, "--hf", "llama4_text", "--steps", "2", "--precision", "bf16",
                   "--optimizer", "adamw")


@pytest.mark.parametrize("model_type", ["olmo2", "inkling_text"])
def test_bf16_adamw_keeps_the_models_own_casts(model_type, capsys):
    """OLMo 2's q/k norms return `x.to(input_dtype)`, bf16 under autocast;
    Inkling's router runs under `torch.autocast(enabled=False)`. The fp32
    capture lost both (an identity cast; a linear the lists lower), and
    bf16 AdamW said MISMATCH on those tensors, 20-40% off eager's updates.
    A bf16 capture runs the forward under autocast (`capture/model_casts.py`);
    its planted tests are tests/capture/test_model_casts.py."""
    verifies_equal(capsys, "--hf", model_type, "--steps", "3", "--precision", "bf16",
                   "--optimizer", "adamw")
