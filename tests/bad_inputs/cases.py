"""The catalogue of bad inputs: what a person might type or hand over, the
error class meshplan must raise, and a phrase its one-line message must hold.

A case is either a command line (`argv`, run as `meshplan ARGV`; `{tmp}` is
the case's own directory, `{plans}` a copy of a good plan directory and
`{ckpt}` a copy of a good checkpoint, after `damage` is applied to that
copy) or a Python call (`call(tmp)`, for inputs no flag can express: custom
modules, schedules). `test_catalogue.py` runs them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from meshplan.errors import CaptureError, ConfigError, PlanError, RuntimeFault, ScheduleError
from tests.bad_inputs import files, models
from tests.bad_inputs.files import PLAN_FLAGS, VERSION


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    error: type
    phrase: str
    argv: tuple[str, ...] = ()
    call: Callable[[Path], object] | None = None
    plans: Callable[[Path], None] | None = None  # damage to a copy of the good plans
    ckpt: Callable[[Path], None] | None = None   # damage to a copy of the good checkpoint
    env: dict = field(default_factory=dict)


def cli(id, category, error, phrase, *argv, **kw) -> Case:
    return Case(id, category, error, phrase, argv=argv, **kw)


def py(id, category, error, phrase, call, **kw) -> Case:
    return Case(id, category, error, phrase, call=call, **kw)


# ---- Python inputs -----------------------------------------------------------------------

def _capture(module_cls, **kw):
    def call(tmp):
        from meshplan.capture import capture

        return capture(module_cls(), models.example(), **kw)
    return call


def _checked(module_cls):
    """`mp.capture`: capture and its self-check (real weights)."""
    def call(tmp):
        import meshplan.api as mp

        torch.manual_seed(0)
        return mp.capture(module_cls(), models.example())
    return call


def _capture_targets(tmp):
    from meshplan.capture import capture

    return capture(models.NoLoss(), models.example(), loss_fn=F.mse_loss,
                   targets=(models.example()[0][:, :3],))


def _plan_tied(tmp):
    """A tied weight that two tp styles would split differently."""
    from meshplan.autodiff import OptimizerConfig, build_train_step
    from meshplan.capture import capture
    from meshplan.ir.mesh import Mesh, Strategy
    from meshplan.passes.plan import plan_job

    graph = build_train_step(capture(models.Tied(), models.example()),
                             OptimizerConfig.default("sgd"), 1)
    s = Strategy(tp=2, global_batch_size=4, micro_batch_size=4,
                 tp_plan=((r"blocks\.0", "colwise"), (r"blocks\.1", "rowwise")))
    return plan_job(graph, Mesh(1, 2), s)


def _derived_no_layers(tmp):
    """layer_pattern='derived' on a model with no list of blocks, at pp=2."""
    from meshplan.autodiff import OptimizerConfig, build_train_step
    from meshplan.capture import capture
    from meshplan.ir.mesh import Mesh, Strategy
    from meshplan.passes.plan import plan_job

    graph = build_train_step(capture(models.NoList(), models.example()),
                             OptimizerConfig.default("sgd"), 2)
    s = Strategy(pp=2, global_batch_size=8, micro_batch_size=4, layer_pattern="derived")
    return plan_job(graph, Mesh(1, 2), s)


def _schedule(name, pp, vpp, m):
    def call(tmp):
        from meshplan.schedules import compute_actions

        return compute_actions(name, pp, vpp, m, 0)
    return call


def _damaged_schedule(damage, rank: int = 1):
    def call(tmp):
        from meshplan.schedules import add_comm, compute_actions, validate

        acts = add_comm({r: compute_actions("1f1b", 2, 1, 4, r) for r in range(2)}, 2)
        damage(acts[rank])
        return validate(acts, 2, 1, 4)
    return call


def _swap_first_f_b(acts):
    i = next(k for k, a in enumerate(acts) if a.type.value == "F")
    j = next(k for k, a in enumerate(acts) if a.type.value == "B")
    acts[i], acts[j] = acts[j], acts[i]


def _drop_last_b(acts):
    del acts[max(k for k, a in enumerate(acts) if a.type.value == "B")]


def _torchrun_env(world: int) -> dict:
    return {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def _name(**fields) -> str:
    """A configuration name, valid unless `fields` replaces one of its parts."""
    parts = dict(model="gpt", nl="nl4", nah="nah4", hs="hs64", precision="FP32", ac="acfalse",
                 mp="mp1", pp="pp1", mb="mb8", gb="gb8", devices="1n1g") | fields
    return "_".join(parts.values())


RUN = ("run", "--steps", "2")
RESUME = (*RUN, "--save-dir", "{ckpt}", "--resume")
OUT = ("--out", "{tmp}/out")
CASES: list[Case] = [
    # ---- strategy and mesh arithmetic ------------------------------------------------
    cli("product", "strategy", ConfigError, "choose dp, tp, pp whose product is 4",
        "plan", "--devices-per-node", "4", "--dp", "3", "--tp", "2"),
    # verify once ran such a layout on its one-process path and said OK: dp2 tp2 untested
    cli("verify-layout-one-rank", "strategy", ConfigError, "pass --devices-per-node 4",
        "verify", "--steps", "1", "--dp", "2", "--tp", "2"),
    cli("verify-cp-one-rank", "strategy", ConfigError, "pass --devices-per-node 2",
        "verify", "--steps", "1", "--cp", "2"),
    cli("verify-sp-tp1", "strategy", ConfigError, "it needs tp > 1",
        "verify", "--steps", "1", "--sequence-parallel"),
    cli("tp-zero", "strategy", ConfigError, "--tp 0 must be >= 1", "plan", "--tp", "0"),
    cli("nodes-zero", "strategy", ConfigError, "--nodes 0 must be >= 1",
        "compile", "--nodes", "0", *OUT),
    cli("micro-batch-zero", "strategy", ConfigError, "--micro-batch-size 0 must be >= 1",
        "plan", "--micro-batch-size", "0"),
    cli("batch-not-multiple", "strategy", ConfigError, "use a global batch of 6 or 8",
        "plan", "--global-batch-size", "7", "--micro-batch-size", "2"),
    cli("batch-contradiction", "strategy", ConfigError, "contradicts --global-batch-size 8",
        "plan", "--global-batch-size", "8", "--num-microbatches", "3"),
    cli("tp-heads", "strategy", ConfigError, "tp=3 does not divide heads=4; choose tp among",
        "compile", "--devices-per-node", "3", "--tp", "3", *OUT),
    cli("tp-resnet", "strategy", ConfigError, "resnet has no tensor-parallel plan",
        "plan", "--model", "resnet", "--devices-per-node", "2", "--tp", "2"),
    cli("ranks-outside", "strategy", ConfigError, "--ranks lists rank 9, outside 0..1",
        "compile", "--devices-per-node", "2", "--tp", "2", "--ranks", "0,9", *OUT),
    cli("ranks-garbage", "strategy", ConfigError, "--ranks 'a-b' is not a list like 0,17",
        "compile", "--devices-per-node", "2", "--tp", "2", "--ranks", "a-b", *OUT),
    cli("flag-type", "strategy", ConfigError, "argument --tp: invalid int value: 'two'",
        "plan", "--tp", "two"),
    cli("flag-unknown", "strategy", ConfigError, "unrecognized arguments: --steps",
        "plan", "--steps", "3"),
    # ---- models -------------------------------------------------------------------------
    cli("model-unknown", "model", ConfigError, "unknown model 'gtp': choose one of",
        "plan", "--model", "gtp"),
    cli("size-unknown", "model", ConfigError, "unknown size 'huge' for gpt: choose one of",
        "compile", "--size", "huge", *OUT),
    cli("heads-hidden", "model", ConfigError, "heads=5 does not divide hidden=64; pick heads",
        "plan", "--heads", "5"),
    cli("layers-zero", "model", ConfigError, "layers=0 must be a positive integer",
        "plan", "--layers", "0"),
    cli("override-wrong-family", "model", ConfigError, "override 'vocab' does not apply",
        "plan", "--model", "resnet", "--vocab", "10"),
    cli("moe-top-k", "model", ConfigError, "top_k=5 must be 1 to the 4 experts (--top-k)",
        "plan", "--model", "moe", "--top-k", "5"),
    cli("moe-capacity", "model", ConfigError, "capacity_factor=0.0 must be above 0",
        "plan", "--model", "moe", "--capacity-factor", "0"),
    cli("moe-experts", "model", ConfigError, "experts=0 must be a positive integer",
        "plan", "--model", "moe", "--experts", "0"),
    cli("ep-no-experts", "strategy", ConfigError, "--ep 2: the model has no expert weights",
        "plan", "--model", "gpt", "--devices-per-node", "2", "--ep", "2"),
    cli("ep-not-dividing-dp", "strategy", ConfigError, "ep=2 does not divide dp=3",
        "plan", "--model", "moe", "--devices-per-node", "3", "--ep", "2",
        "--global-batch-size", "6"),
    cli("ep-with-auto-no-experts", "strategy", ConfigError,
        "--ep 2 with --auto: --model gpt has no experts",
        "plan", "--model", "gpt", "--devices-per-node", "4", "--ep", "2", "--auto",
        "--device-model", "h100-80gb"),
    cli("ep-with-auto-not-dividing", "strategy", ConfigError,
        "--ep 3 does not divide the model's 4 experts",
        "plan", "--model", "moe", "--devices-per-node", "3", "--ep", "3", "--auto",
        "--device-model", "h100-80gb"),
    cli("cp-with-auto-no-sequence", "strategy", ConfigError,
        "--cp 2 with --auto: --model resnet has no sequence",
        "plan", "--model", "resnet", "--devices-per-node", "2", "--cp", "2", "--auto",
        "--device-model", "h100-80gb"),
    cli("cp-no-attention", "strategy", ConfigError,
        "--cp 2: the model has no scaled_dot_product_attention",
        "plan", "--model", "resnet", "--devices-per-node", "2", "--cp", "2"),
    cli("cp-balance-seq", "strategy", ConfigError,
        "--cp 3: load balance splits the sequence into 2 x cp = 6 chunks",
        "plan", "--model", "gpt", "--devices-per-node", "3", "--cp", "3"),
    cli("cp-not-dividing-seq", "strategy", ConfigError,
        "--cp 3 does not divide the sequence's 16 tokens",
        "plan", "--model", "gpt", "--devices-per-node", "3", "--cp", "3", "--no-cp-balance",
        "--micro-batch-size", "1"),
    cli("cp-ring-unequal-blocks", "strategy", ConfigError,
        "--cp-attention ring: --cp 3 does not divide the sequence's 16 tokens",
        "plan", "--model", "gpt", "--devices-per-node", "3", "--cp", "3", "--no-cp-balance",
        "--cp-attention", "ring", "--seq-len", "16"),
    cli("cp-with-ep", "strategy", ConfigError, "with expert parallelism (--ep) is not planned",
        "plan", "--model", "moe", "--devices-per-node", "4", "--cp", "2", "--ep", "2"),
    cli("sp-without-tp", "strategy", ConfigError, "needs tp > 1",
        "plan", "--model", "gpt", "--devices-per-node", "2", "--sequence-parallel"),
    cli("sp-with-auto-no-sequence", "strategy", ConfigError,
        "--sequence-parallel with --auto: --model resnet has no sequence",
        "plan", "--model", "resnet", "--devices-per-node", "2", "--sequence-parallel", "--auto",
        "--device-model", "h100-80gb"),
    # ---- capture (custom modules through the Python API) --------------------------------
    py("data-dependent-mask", "capture", CaptureError, "data-dependent shape",
       _capture(models.MaskedSum)),
    py("data-dependent-nonzero", "capture", CaptureError, "avoid ops like nonzero",
       _capture(models.NonZero)),
    py("unsupported-op", "capture", CaptureError, "not an aten op, so no generic rule applies",
       _capture(models.Branch)),
    py("gradient-hook", "capture", CaptureError,
       "gradient of 'fc.weight' through torch.export's program differs from its own backward",
       _checked(models.GradientHook)),
    py("function-draws", "capture", CaptureError,
       "_Noisy draws random numbers (aten.rand_like.default); meshplan runs its forward again",
       _capture(models.RandomFunction)),
    py("torchs-draw", "capture", CaptureError,
       "aten.randperm.default draws random numbers from torch's generator",
       _capture(models.TorchsDraw)),
    py("constant-too-large", "capture", CaptureError,
       "has more than 64 elements to make on every rank; register it with register_buffer",
       _capture(models.LargeConstant)),
    py("python-branch-on-data", "capture", CaptureError, "pick with torch.where",
       _capture(models.PythonBranch)),
    py("no-loss", "capture", CaptureError, "not a scalar loss; return the loss, or pass loss_fn",
       _capture(models.NoLoss)),
    py("two-outputs", "capture", CaptureError, "returns tuple, not a scalar loss tensor",
       _capture(models.TwoOutputs)),
    py("integer-loss", "capture", CaptureError, "returns a int64 tensor of shape []",
       _capture(models.IntegerLoss)),
    py("input-shape", "capture", CaptureError, "check that the inputs fit the model",
       _capture_targets),
    # ---- layer patterns -------------------------------------------------------------------
    cli("pattern-regex", "layers", ConfigError, "is not a valid regular expression",
        "plan", "--devices-per-node", "2", "--pp", "2", "--layer-pattern", "("),
    cli("pattern-no-match", "layers", ConfigError, "matches no forward op's module path",
        "plan", "--devices-per-node", "2", "--pp", "2", "--layer-pattern", r"layer\.(\d+)"),
    cli("layers-pp", "layers", ConfigError, "pp must divide the layer count: valid pp values",
        "compile", "--devices-per-node", "2", "--pp", "2", "--layers", "3", *OUT),
    cli("layers-vpp", "layers", ConfigError, "pass a --vpp that divides 2",
        "plan", "--devices-per-node", "2", "--pp", "2", "--vpp", "3"),
    cli("layer-stages-count", "layers", ConfigError, "give exactly 4 stage ids",
        "plan", "--devices-per-node", "2", "--pp", "2", "--layer-stages", "0,1"),
    cli("layer-stages-range", "layers", ConfigError, "layer_stages[2] = 5 is outside [0, 2)",
        "plan", "--devices-per-node", "2", "--pp", "2", "--layer-stages", "0,0,5,5"),
    cli("layer-stages-text", "layers", ConfigError, "is not a comma-separated list",
        "plan", "--devices-per-node", "2", "--pp", "2", "--layer-stages", "0,x"),
    py("tied-styles", "layers", ConfigError, "give the modules sharing it styles that split",
       _plan_tied),
    py("derived-no-layers", "layers", ConfigError, "layer_pattern 'derived' found no layer list",
       _derived_no_layers),
    # ---- transformers models (--hf) ---------------------------------------------------
    cli("hf-unknown-type", "model", ConfigError, "has no model_type 'nosuch'",
        "compile", "--hf", "nosuch", *OUT),
    cli("hf-not-an-lm", "model", ConfigError, "cannot build hf:vit",
        "verify", "--hf", "vit"),
    cli("hf-tp-vocab", "model", ConfigError, "tp=3 does not divide the vocabulary (128)",
        "compile", "--hf", "gpt2", "--devices-per-node", "3", "--tp", "3", *OUT),
    cli("hf-tp-heads", "model", ConfigError, "tp=8 does not divide the 4 attention heads",
        "run", "--hf", "llama", "--devices-per-node", "8", "--tp", "8"),
    # ---- schedules and micro-batch counts ----------------------------------------------
    cli("1f1b-too-few", "schedule", ConfigError, "needs num_microbatches >= pp",
        "plan", "--devices-per-node", "2", "--pp", "2", "--num-microbatches", "1"),
    cli("interleaved-multiple", "schedule", ConfigError, "use --num-microbatches 2 or 4",
        "compile", "--devices-per-node", "2", "--pp", "2", "--vpp", "2",
        "--num-microbatches", "3", *OUT),
    cli("schedule-unknown", "schedule", ConfigError, "invalid choice: 'zigzag'",
        "plan", "--devices-per-node", "2", "--pp", "2", "--schedule", "zigzag"),
    py("schedule-name", "schedule", ScheduleError, "unknown schedule 'zigzag'",
       _schedule("zigzag", 2, 1, 4)),
    py("schedule-zero", "schedule", ScheduleError, "num_microbatches must be a positive",
       _schedule("gpipe", 2, 1, 0)),
    py("schedule-vpp", "schedule", ScheduleError, "use --vpp 1 or --schedule interleaved",
       _schedule("1f1b", 2, 2, 4)),
    py("schedule-b-before-f", "schedule", ScheduleError, "<-- ERROR HERE",
       _damaged_schedule(_swap_first_f_b)),
    py("schedule-missing-b", "schedule", ScheduleError, "never runs",
       _damaged_schedule(_drop_last_b, rank=0)),
    # ---- plan files ---------------------------------------------------------------------
    cli("plan-truncated", "files", PlanError, "rank_00001.plan is truncated",
        "check", "{plans}", plans=files.truncate),
    cli("plan-corrupt", "files", PlanError, "checksum mismatch", "check", "{plans}",
        plans=files.flip_digit),
    cli("plan-hand-edited", "files", PlanError, "was edited or corrupted; recompile it",
        "show", "{plans}", plans=files.edit_rank_field),
    cli("plan-version", "files", PlanError,
        f"format version {VERSION + 1}, this meshplan reads version {VERSION}",
        "check", "{plans}", plans=files.other_version),
    cli("plan-missing-rank", "files", PlanError, "lacks the plans of ranks 1 (world 2)",
        "show", "{plans}", plans=files.drop_rank),  # `check` says partial (exit 0)
    cli("plan-extra-rank", "files", PlanError, "outside world 2; recompile",
        "check", "{plans}", plans=files.extra_rank),
    cli("plan-resealed-malformed", "files", PlanError, "malformed meshplan.rankplan",
        "check", "{plans}", plans=files.reseal_malformed),
    cli("job-missing", "files", PlanError, "job.json does not exist", "check", "{plans}",
        plans=files.drop_job),
    cli("job-wrong-kind", "files", PlanError, "not a 'meshplan.job' file",
        "check", "{plans}", plans=files.plan_as_job),
    cli("job-replaced", "files", PlanError, "was lowered from another Job",
        "check", "{plans}", plans=files.reseal_job),
    cli("plans-dir-missing", "files", PlanError, "does not exist; run `meshplan compile",
        "check", "{tmp}/nothing"),
    cli("out-is-a-file", "files", PlanError, "is a file, not a directory",
        "compile", "--out", "{plans}/job.json", plans=lambda d: None),
    cli("show-rank", "files", ConfigError, "--rank 7 is not in", "show", "{plans}",
        "--rank", "7", plans=lambda d: None),
    # ---- checkpoints ---------------------------------------------------------------------
    cli("resume-no-dir", "checkpoint", ConfigError, "--resume needs --save-dir",
        *RUN, "--resume"),
    cli("resume-missing", "checkpoint", RuntimeFault, "does not exist; run with --save-dir",
        *RUN, "--save-dir", "{tmp}/none", "--resume"),
    cli("resume-incomplete", "checkpoint", RuntimeFault, "is incomplete (no COMPLETE marker",
        *RESUME, ckpt=files.drop_complete),
    cli("resume-edited", "checkpoint", RuntimeFault, "damaged COMPLETE marker (checksum mismatch",
        *RESUME,
        ckpt=files.edit_complete),
    cli("resume-metadata-edited", "checkpoint", RuntimeFault, ".metadata is missing or not the",
        *RESUME, ckpt=files.edit_metadata),
    cli("resume-other-size", "checkpoint", RuntimeFault, "saved from another model size",
        *RESUME, "--hidden", "32", ckpt=lambda d: None),
    cli("resume-other-model", "checkpoint", RuntimeFault, "saved from another model",
        *RESUME, "--model", "resnet", ckpt=lambda d: None),
    # ---- run-time mismatches -------------------------------------------------------------
    cli("run-world", "runtime", RuntimeFault, "holds plans for 2 ranks but 4 were asked for",
        *RUN, "--devices-per-node", "4", "--plan-dir", "{plans}", plans=lambda d: None),
    cli("run-missing-rank", "runtime", PlanError, "lacks the plans of ranks 1",
        *RUN, *PLAN_FLAGS, "--plan-dir", "{plans}", plans=files.drop_rank),
    cli("run-other-model", "runtime", PlanError, "was compiled for another model",
        *RUN, *PLAN_FLAGS, "--hidden", "32", "--plan-dir", "{plans}", plans=lambda d: None),
    cli("run-inconsistent-plan", "runtime", PlanError, "fails `meshplan check`",
        *RUN, *PLAN_FLAGS, "--plan-dir", "{plans}", plans=files.reseal_wrong_peer),
    cli("torchrun-world", "runtime", RuntimeFault, "torchrun started 3 ranks but the strategy",
        *RUN, "--devices-per-node", "2", "--tp", "2", env=_torchrun_env(3)),
    cli("run-threads", "runtime", ConfigError, "--threads 0 must be a positive integer",
        *RUN, "--threads", "0"),
    cli("run-steps", "runtime", ConfigError, "--steps 0 must be a positive integer",
        "run", "--steps", "0"),
    cli("run-timeout", "runtime", ConfigError, "--timeout 0.0 must be a positive number",
        *RUN, "--timeout", "0"),
    # ---- configuration names (--config NAME) ---------------------------------------------
    cli("config-bad-field", "config", ConfigError, "field 'hsX' should be hs<hidden size>",
        "plan", "--config", _name(hs="hsX")),
    cli("config-bad-model", "config", ConfigError, "field 'gtp' is not a model; use one of",
        "compile", "--config", _name(model="gtp"), *OUT),
    cli("config-bad-precision", "config", ConfigError, "field 'FP8' should be FP32, BF16",
        "run", "--config", _name(precision="FP8")),
    cli("config-bad-recompute", "config", ConfigError, "should be actrue or acfalse",
        "plan", "--config", _name(ac="acmaybe")),
    cli("config-mesh-mismatch", "config", ConfigError, "but the mesh has 1x2 = 2 ranks",
        "compile", "--config", _name(mp="mp2", pp="pp2", mb="mb2", devices="1n2g"), *OUT),
    cli("config-no-nodes", "config", ConfigError, "field '0n4g' should be <nodes>n<devices",
        "plan", "--config", _name(devices="0n4g")),
    cli("config-field-count", "config", ConfigError, "has 2 fields separated by '_'",
        "plan", "--config", "gpt_nl4"),
    cli("config-flag-contradicts", "config", ConfigError, "--tp 4 contradicts --config",
        "plan", "--config", _name(mp="mp2", devices="1n2g"), "--tp", "4"),
    cli("config-heads-hidden", "config", ConfigError, "heads=3 does not divide hidden=64",
        "plan", "--config", _name(nah="nah3")),
]
