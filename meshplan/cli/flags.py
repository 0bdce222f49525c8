"""Flags shared by the verbs: the model, and the parallel strategy.

Every verb that plans (`plan`, `compile`, `run`, `verify`) takes the same
strategy flags, with Megatron's names.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from meshplan.autodiff import OptimizerConfig
from meshplan.cli.auto_flags import add_auto_flags
from meshplan.cli.config_name import format_config_name, parse_config_name
from meshplan.cli.train_config import is_config_file
from meshplan.errors import ConfigError, ScheduleError
from meshplan.ir.choices import (
    Kernels,
    LrScheduleKind,
    NonFinite,
    OptimizerKind,
    Precision,
    Recompute,
    names,
)
from meshplan.ir.lr_schedule import LrSchedule
from meshplan.ir.mesh import BALANCED, CP_ATTENTION, DERIVED, Mesh
from meshplan.ir.zero import ZeroLevel
from meshplan.models import model_config
from meshplan.runtime.devices import DEVICES
from meshplan.schedules.csv_io import load_csv
from meshplan.schedules.registry import CSV, default_schedule, searched, spec_of


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="gpt",
                   help="gpt, bert, resnet or moe (a mixture-of-experts GPT; default gpt)")
    g.add_argument("--hf", default=None, metavar="MODEL_TYPE",
                   help="a transformers model built offline from its config instead of a zoo "
                   "model: gpt2, bert, llama, ... (tp plan and layers derived: 'derived')")
    g.add_argument("--size", default="tiny", help="preset: tiny, small, gpt3-175b, "
                   "bert-large, resnet50 (default tiny)")
    for flag in ("layers", "heads", "hidden", "seq-len", "vocab"):
        g.add_argument(f"--{flag}", type=int, default=None, help=f"override the preset's {flag}")
    g.add_argument("--target-len", type=int, default=None, metavar="N",
                   help="an encoder-decoder (--hf t5, bart, ...): its targets' length, the "
                   "decoder's (default: --seq-len, the source's)")
    g.add_argument("--pack", dest="packed", action="store_true", default=None,
                   help="a causal LM on pairs (gpt, moe dropless, a transformers one): pack whole "
                   "pairs into each row, each attending to its own tokens (position ids "
                   "restart at each)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="the output head shares the token embedding's weight (gpt, --hf)")
    g.add_argument("--experts", type=int, default=None, help="moe: experts per block")
    g.add_argument("--top-k", type=int, default=None, help="moe: experts each token takes")
    g.add_argument("--capacity-factor", type=float, default=None,
                   help="moe: an expert takes at most this times its even share of a "
                        "sample's tokens, the rest dropped (default: dropless)")
    g.add_argument("--dropout", type=float, default=None,
                   help="dropout probability of every dropout (gpt, bert, --hf; default 0): "
                        "the masks are the same at any layout (docs/concepts/randomness.md)")


def overrides(a: argparse.Namespace) -> dict:
    keys = ("layers", "heads", "hidden", "seq_len", "vocab", "tie_embeddings", "dropout", "source",
            "experts", "top_k", "capacity_factor", "target_len", "packed")
    return {k: getattr(a, k) for k in keys if getattr(a, k, None) is not None}


def add_strategy_flags(p: argparse.ArgumentParser, default_gbs: int = 8) -> None:
    g = p.add_argument_group("parallel strategy")
    g.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    g.add_argument("--devices-per-node", type=int, default=1, help="ranks per machine")
    g.add_argument("--dp", type=int, default=None, help="data parallel (default: the rest)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism (tp > 1): the norms and residual "
                   "adds between tensor-parallel blocks run on sequence shards; each "
                   "all-reduce becomes a reduce-scatter and an all-gather")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--ep", type=int, default=1,
                   help="expert parallel: split each mixture of experts' experts over this "
                   "many ranks of a data-parallel group (it divides dp, as Megatron's "
                   "--expert-model-parallel-size); tokens reach them by all-to-all")
    g.add_argument("--cp", type=int, default=1,
                   help="context parallel: split each sequence over this many ranks (the "
                   "inputs and activations by sequence, attention's keys and values "
                   "gathered whole); for long contexts")
    g.add_argument("--cp-attention", choices=CP_ATTENTION, default="auto",
                   help="with --cp, attention's form: allgather (each rank's query rows "
                   "against keys and values gathered, as Llama 3), alltoall (heads split by "
                   "all-to-all, as DeepSpeed Ulysses), auto (the cheaper by the plan's costs)")
    g.add_argument("--cp-balance", action=argparse.BooleanOptionalAction, default=None,
                   help="with --cp: reorder the sequence so that each rank holds a head and "
                   "a tail chunk, balancing causal attention (the default); "
                   "--no-cp-balance keeps it in order")
    g.add_argument("--vpp", type=int, default=None,
                   help="virtual stages (chunks) per stage (default 1; 2 for zbv; a CSV's own)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help=f"samples per step (default {default_gbs})")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per micro-batch per dp rank")
    g.add_argument("--num-microbatches", type=int, default=None,
                   help="shorthand: global batch = this x micro-batch x dp")
    g.add_argument("--schedule", choices=searched(),
                   default=None, help="pipeline schedule (default 1f1b; interleaved when "
                   "vpp > 1); zb1p and zbv split the backward into I and W (zero bubble)")
    g.add_argument("--schedule-csv", default=None, metavar="FILE",
                   help="run a hand-written schedule: torch's pipeline CSV, one row of "
                   "compute actions (0F0, 1I2, 1W2, 3B1) per pipeline rank")
    g.add_argument("--zero", type=int, choices=[int(z) for z in ZeroLevel], default=0,
                   help="sharded data parallel (ZeRO): 1 shards the optimizer state over dp, "
                   "2 the gradients too, 3 the parameters too (gathered before each use, "
                   "as FSDP does); default 0, plain data parallel")
    g.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradient buckets: the step's gradient reductions over dp are "
                   "coalesced into buckets of this many MiB and started during the last "
                   "micro-batch's backward (default 25, DDP's; 0: one reduction per gradient, "
                   "in the step)")
    g.add_argument("--layer-pattern", default=None,
                   help=r"regex over module paths naming a layer (default: blocks\.(\d+)); "
                   "'derived': the longest nn.ModuleList the forward runs")
    g.add_argument("--tp-plan", choices=(DERIVED,), default=None,
                   help="derived: the tensor-parallel plan read off the model (transformers' "
                   "own plan, else its vocabulary embedding and head)")
    g.add_argument("--layer-stages", default=None,
                   help="stage of each layer, comma-separated, e.g. 0,0,1,1")
    g.add_argument("--stage-layers", default=None,
                   help="layers per virtual stage, comma-separated, e.g. 3,4,4,3 (an uneven "
                   "layout, as --auto chooses); 'balanced': balanced by cost (embedding, head "
                   "and loss counted)")
    add_auto_flags(p.add_argument_group("automatic strategy (the search)"))
    g = p.add_argument_group("training step")
    g.add_argument("--precision", choices=names(Precision), default="fp32",
                   help="compute precision: bf16/fp16 run matmul, linear, attention and conv "
                   "in low precision with fp32 master weights (fp16 adds loss scaling)")
    g.add_argument("--initial-loss-scale", type=float, default=65536.0,
                   help="fp16: the dynamic loss scale to start from (default 2^16)")
    g.add_argument("--recompute", choices=names(Recompute), default="none",
                   help="activation checkpointing: full keeps only each region's input, "
                   "selective also keeps matmul/attention outputs")
    g.add_argument("--recompute-pattern", default=None,
                   help="regex over module paths naming the checkpointed regions "
                   "(default: the layer pattern)")
    g = p.add_argument_group("configuration names")
    g.add_argument("--config", default=None, metavar="NAME",
                   help="a configuration name, e.g. "
                   "bert_nl4_nah4_hs64_FP32_actrue_mp2_pp1_mb4_gb8_1n4g")
    g.add_argument("--print-config", action="store_true",
                   help="print the configuration name of the flags and exit")
    p.set_defaults(default_gbs=default_gbs, flag_parser=p)


def add_optimizer_flags(g) -> None:
    """The optimizer the train step is built with (it is part of the Job)."""
    g.add_argument("--optimizer", choices=names(OptimizerKind), default="sgd")
    g.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: sgd 0.05, adamw 3e-3)")
    g.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="clip the gradients to this global 2-norm, as torch's "
                   "clip_grad_norm_ (the norm is derived from the layouts and proven to "
                   "count every parameter once); default: no clipping")
    g.add_argument("--lr-schedule", choices=names(LrScheduleKind), default="constant",
                   help="the learning rate after a linear warmup: constant, linear or cosine "
                   "decay to --min-lr over --decay-steps, or wsd (warmup-stable-decay: "
                   "linear to --min-lr over the run's last --decay-steps)")
    g.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                   help="linear warmup: step k < N takes lr * (k+1)/(N+1)")
    g.add_argument("--decay-steps", type=int, default=None, metavar="N",
                   help="steps of the decay (default: the run's steps after the warmup)")
    g.add_argument("--min-lr", type=float, default=0.0, metavar="X",
                   help="the rate the decay ends at (default 0)")
    g.add_argument("--on-nonfinite", choices=names(NonFinite), default=None,
                   help="a step whose gradient norm is inf/nan: halt (stop, naming the step; "
                   "the default with --clip-grad-norm: a diverged run should not go on "
                   "silently) or skip (no rank applies it; counted and reported). Needs the "
                   "norm: without clipping, giving it computes the norm")
    g.add_argument("--no-decay", default="", metavar="REGEX",
                   help="parameters without weight decay, by a regex over their names; "
                   "'none' decays every parameter (default: the 1-D ones: biases and norm "
                   "weights, as Megatron and LiBai)")


def optimizer_config(a: argparse.Namespace):
    """The `OptimizerConfig` the optimizer flags name (the run's `--steps`, if
    the verb has them, end a decay that names no length)."""
    schedule = LrSchedule(a.lr_schedule, a.warmup_steps, a.decay_steps, a.min_lr,
                          getattr(a, "steps", None))
    cfg = OptimizerConfig.of(a.optimizer, a.lr, max_grad_norm=a.clip_grad_norm,
                             no_decay=a.no_decay, lr_schedule=schedule,
                             on_nonfinite=a.on_nonfinite)
    schedule.resolved(cfg.lr)  # a bad schedule is the user's mistake, said before planning
    return cfg


def add_training_flags(p: argparse.ArgumentParser, steps: int) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    add_optimizer_flags(g)
    g.add_argument("--seed", type=int, default=0, help="model and data seed")


BACKEND_HELP = ("gloo or nccl (default: nccl on cuda, gloo on cpu). With --device cuda, "
                "gloo lets ranks share GPUs (more ranks than GPUs) by staging every "
                "transfer through host memory: for testing plans on a small machine, "
                "not for speed")


def add_device_flags(p: argparse.ArgumentParser, backend: bool = True) -> None:
    """`--device` (and `--backend`, for verbs that run ranks)."""
    g = p.add_argument_group("device")
    g.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where ranks compute (default cpu); auto: cuda when this machine "
                   "has one. Plans are lowered per device type (its kernels)")
    if backend:
        g.add_argument("--backend", choices=("gloo", "nccl"), default="", help=BACKEND_HELP)
        g.add_argument("--kernels", choices=[k.value for k in Kernels], default="eager",
                       help="eager (default): one aten kernel per op; inductor: each run of "
                       "compute ops between two communications compiled by Inductor, once "
                       "per process at its first step (needs a C++ compiler on cpu, Triton "
                       "on cuda)")


def add_verb(sub, name: str, help: str, epilog: str, run, planning: bool = True,
             json_help: str = "print one JSON object") -> argparse.ArgumentParser:
    """A sub-command with examples, `--json`, and (if `planning`) the model
    and strategy flags every planning verb shares."""
    p = sub.add_parser(name, help=help, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    if planning:
        add_model_flags(p)
        add_strategy_flags(p)
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(run=run)
    return p


def mesh_of(a: argparse.Namespace) -> Mesh:
    return Mesh(a.nodes, a.devices_per_node)


_POSITIVE = ("nodes", "devices_per_node", "dp", "tp", "pp", "vpp", "ep", "cp", "global_batch_size",
             "micro_batch_size", "num_microbatches")


def check_positive(a: argparse.Namespace, names) -> None:
    """Each given flag of `names` is >= 1 (a 0 would read as "unset" below)."""
    for name in names:
        value = getattr(a, name, None)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {value} must be >= 1; pass a positive count, or leave "
                              f"{flag} out for its default")


def strategy_fields(a: argparse.Namespace) -> dict:
    """The Strategy fields the flags say, with Megatron's batch arithmetic."""
    check_positive(a, _POSITIVE)
    world = a.nodes * a.devices_per_node
    cp = getattr(a, "cp", 1)
    dp = a.dp if a.dp is not None else max(1, world // max(1, a.tp * a.pp * cp))
    csv_text = read_schedule_csv(a.schedule_csv) if a.schedule_csv else ""
    vpp = a.vpp or (csv_vpp(csv_text, a.pp) if csv_text
                    else (spec_of(a.schedule).chunks or 1) if a.schedule else 1)
    mbs = a.micro_batch_size
    if a.num_microbatches is not None:
        mbs = mbs or 1
        gbs = a.num_microbatches * mbs * dp
        if a.global_batch_size is not None and a.global_batch_size != gbs:
            raise ConfigError(f"--num-microbatches {a.num_microbatches} x micro-batch {mbs} x "
                              f"dp {dp} = {gbs} contradicts --global-batch-size "
                              f"{a.global_batch_size}; give one of the two")
    else:
        gbs = a.global_batch_size or a.default_gbs
        mbs = mbs or max(1, gbs // (dp * max(a.pp, 1) * (2 if vpp > 1 else 1)))
    fields = {"dp": dp, "tp": a.tp, "pp": a.pp, "vpp": vpp, "ep": a.ep, "cp": cp,
              "global_batch_size": gbs,
              "micro_batch_size": mbs, "schedule": a.schedule or default_schedule(vpp),
              "precision": a.precision, "recompute": a.recompute,
              "initial_loss_scale": a.initial_loss_scale, "zero": a.zero,
              "bucket_mb": a.bucket_mb}
    if getattr(a, "sequence_parallel", False):
        fields["sequence_parallel"] = True
    if getattr(a, "cp_balance", None) is False:
        fields["cp_balance"] = False
    if getattr(a, "cp_attention", "auto") != "auto":
        fields["cp_attention"] = a.cp_attention
    if csv_text:
        if a.schedule:
            raise ConfigError(f"--schedule {a.schedule} and --schedule-csv {a.schedule_csv} "
                              "both name the schedule; give one")
        fields |= {"schedule": CSV, "schedule_orders": checked_orders(
            csv_text, a.schedule_csv, a.pp, vpp, gbs // (mbs * dp))}
    if a.recompute_pattern:
        fields["recompute_pattern"] = a.recompute_pattern
    if a.layer_pattern:
        fields["layer_pattern"] = a.layer_pattern
    if getattr(a, "tp_plan", None):
        fields["tp_plan"] = a.tp_plan
    if a.stage_layers == BALANCED:
        fields["stage_layers"] = BALANCED
    elif a.stage_layers:
        fields["stage_layers"] = _ints(a.stage_layers, "--stage-layers", f"3,4,4,3, or {BALANCED}")
    if a.layer_stages:
        fields["layer_stages"] = _ints(a.layer_stages, "--layer-stages", "0,0,1,1")
    return fields


def _ints(text: str, flag: str, example: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} '{text}' is not a comma-separated list of whole numbers, "
                          f"e.g. {example}") from None


def read_schedule_csv(path: str) -> str:
    """The text of the schedule CSV at `path` (a ConfigError line if unreadable)."""
    try:
        return Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"--schedule-csv {path}: cannot read it ({err.strerror}); give the "
                          "path of a schedule CSV (meshplan show DIR --csv FILE writes one)"
                          ) from None


def csv_vpp(text: str, pp: int) -> int:
    """The chunks per rank a schedule CSV implies: its distinct stages over pp."""
    stages = set(re.findall(r"(?:^|,)\s*(\d+)[A-Z]", text, flags=re.M))
    return max(1, len(stages) // max(pp, 1))


def checked_orders(text: str, path: str, pp: int, vpp: int, microbatches: int):
    """The CSV's compute orders as text, checked as a schedule
    (`schedules/csv_io.load_csv`: one line naming the row, column and rule broken)."""
    try:
        orders = load_csv(text, pp, vpp, microbatches)
    except ScheduleError as err:
        raise ScheduleError(f"--schedule-csv {path}: {err}") from None
    return tuple(tuple(str(act) for act in orders[r]) for r in range(pp))


def apply_config(a: argparse.Namespace) -> None:
    """Fill the flags from `--config NAME`; a flag given too must agree with it.
    A `--config FILE.toml` is left to verbs that read settings files
    (`train_config.resolve`); any other verb refuses it."""
    if not getattr(a, "config", None):
        return

    if is_config_file(a.config):
        if getattr(a, "config_files", False):
            return
        raise ConfigError(f"--config {a.config}: this verb takes a configuration name, not a "
                          "TOML file (`meshplan train` reads those); give a name, e.g. "
                          "gpt_nl4_nah4_hs64_FP32_actrue_mp2_pp1_mb4_gb8_1n4g")

    parser = a.flag_parser
    for dest, value in parse_config_name(a.config).items():
        given = getattr(a, dest)
        if given != parser.get_default(dest) and given != value:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} {given} contradicts --config {a.config}, which says "
                              f"{value}; drop the flag or change the name")
        setattr(a, dest, value)


def config_name_of(a: argparse.Namespace) -> str:
    """The configuration name the flags describe (for `--print-config`)."""
    cfg = model_config(a.model, a.size, **overrides(a))
    f = strategy_fields(a)
    return format_config_name(f | {"model": a.model, "layers": cfg.layers, "heads": cfg.heads,
                                    "hidden": cfg.hidden, "nodes": a.nodes,
                                    "devices_per_node": a.devices_per_node})
