"""The `train` verb: a training run of a language model on a prepared token
directory, from the user's flags (or a TOML config) to a trained model.

Invariants:
- Every mistake the flags, the config or the data can hold is found before
  the run's directory is written: one line, exit 2, no partial files.
- The verb's defaults are the main job: GPT small on the Python standard
  library's own sources (byte tokens, prepared on first use under
  `$MESHPLAN_HOME/data/`), 8 local ranks (dp2 tp2 pp2 vpp2, interleaved),
  AdamW with a cosine schedule, clipping at 1.0, 160 steps, evaluation
  every 20.
- The run's directory holds `config.toml` (the resolved config: every
  flag's value), `metrics.jsonl` (and `tensorboard/` when installed),
  `loss.png` and the trained weights (`model.safetensors`, or `model.pt`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from statistics import median

from meshplan.cli.auto_cmd import strategy_of
from meshplan.cli.export_cmd import export_lines
from meshplan.cli.flags import mesh_of, optimizer_config, overrides, strategy_fields
from meshplan.cli.pictures import draw_training
from meshplan.cli.train_config import add_config_file_flags, is_config_file, resolve, write_resolved
from meshplan.costmodel.load import meshplan_home
from meshplan.data.feed import PACKED, PAIRED, FeedReader, Layout, TokenFeed
from meshplan.data.prepare import prepare_data
from meshplan.driver.export import ExportFormat, check_out, export, memory_source
from meshplan.driver.init_from import is_pretrained_dir, weight_source
from meshplan.driver.metrics import perplexity, read_metrics
from meshplan.driver.model_record import model_record
from meshplan.driver.run import train_timeout, under_torchrun
from meshplan.driver.train import (
    CHECKPOINTS,
    complete_checkpoints,
    peak_capacity,
    tokens_to_steps,
    train_job,
)
from meshplan.driver.train_model import (
    answer_sample,
    fill_sample,
    language_model,
    pack_fill,
    pair_cuts,
    sample_text,
    sized_config,
    stdlib_files,
    unigram_entropy,
    user_model,
    write_weights,
)
from meshplan.driver.train_torchrun import train_here
from meshplan.errors import ConfigError
from meshplan.ir.fileio import write_atomic
from meshplan.ir.mesh import DERIVED, Strategy
from meshplan.models.hf import HFLoss, saved_config
from meshplan.runtime.checkpoint import COMPLETE, check_resumable
from meshplan.runtime.state import weights_of

EPILOG = """defaults (the main job; the per-flag defaults above are the other verbs'):
  --size small --devices-per-node 8 --tp 2 --pp 2 --vpp 2 --global-batch-size 16
  --micro-batch-size 2 --optimizer adamw --lr 3e-3 --lr-schedule cosine --warmup-steps 10
  --min-lr 3e-4 --clip-grad-norm 1.0 --steps 160 --eval-every 20
examples:
  meshplan train                                   # the main job (3-5 min on 2 cores)
  meshplan prepare-data --input 'corpus/*.txt' --out data/ --tokenizer bpe:4096
  meshplan train --data data/ --size tiny --devices-per-node 4 --tp 1 --pp 2 --vpp 1 \\
      --steps 30 --eval-every 10 --out run1/
  meshplan train --config run.toml --set lr=3e-4 --set steps=200
  meshplan train --hf llama --size tiny --data data/ --devices-per-node 2 --tp 1 --pp 2 --vpp 1
  meshplan train --hf bert --size tiny --data data/ --devices-per-node 2 --tp 1 --pp 2 --vpp 1 \\
      --mask-rate 0.15                             # a masked LM: BERT's masking
  meshplan train --module mymodels:tiny_lm --data data/ --devices-per-node 2 --tp 1 --pp 2 \\
      --vpp 1 --seq-len 64"""

MAIN_JOB = {"size": "small", "devices_per_node": 8, "tp": 2, "pp": 2, "vpp": 2,
            "optimizer": "adamw", "lr": 3e-3, "lr_schedule": "cosine", "warmup_steps": 10,
            "min_lr": 3e-4, "clip_grad_norm": 1.0, "global_batch_size": 16,
            "micro_batch_size": 2, "steps": 160, "eval_every": 20}


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """The train-only flags, and the main job's defaults for the shared ones."""
    g = p.add_argument_group("the run")
    g.add_argument("--data", default="", metavar="DIR",
                   help="a token directory written by `meshplan prepare-data` (default: the "
                   "Python standard library's sources, byte tokens, prepared on first use)")
    g.add_argument("--module", default="", metavar="PKG.MODULE:FACTORY",
                   help="train your own nn.Module instead of --model/--hf: FACTORY(vocab_size=, "
                   "seq_len=) (the keywords it takes) returns a module whose forward(inputs, "
                   "targets) returns the next-token loss")
    g.add_argument("--out", default="meshplan-train", metavar="DIR",
                   help="the run's directory: config, metrics, loss.png, weights "
                   "(default meshplan-train/)")
    g.add_argument("--tokens", type=int, default=None, metavar="N",
                   help="train on N tokens (steps = N / (global batch x seq-len), rounded up); "
                   "instead of --steps")
    g.add_argument("--eval-every", type=int, default=20, metavar="N",
                   help="evaluate on the validation split before the first step and every N "
                   "steps (0: never; default 20)")
    g.add_argument("--eval-batches", type=int, default=4, metavar="B",
                   help="global batches per evaluation (default 4)")
    g.add_argument("--stall-timeout", type=float, default=300.0, metavar="S",
                   help="a rank with no progress for S seconds ends the run, named "
                   "(default 300); there is no overall time limit")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="save a checkpoint (DCP shards of every rank, any layout can resume "
                   "it) in OUT/checkpoints/step_K every N steps (default 0: never)")
    g.add_argument("--async-checkpoint", action="store_true",
                   help="save checkpoints in the background: each rank copies its state to "
                   "host memory and trains on while a thread writes it (default: training "
                   "waits for the save)")
    g.add_argument("--keep", type=int, default=3, metavar="K",
                   help="keep the newest K complete checkpoints; an older one is deleted only "
                   "once a newer one is complete (default 3; 0: all)")
    g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="when a rank fails (killed, stalled), restart the run from the newest "
                   "complete checkpoint, up to N times (default 0: the run ends; needs "
                   "--checkpoint-every)")
    g.add_argument("--resume", nargs="?", const="latest", default="", metavar="DIR",
                   help="continue from a checkpoint: the newest complete one under --out "
                   "(no DIR), or DIR (a checkpoint, or a run's directory); any parallel "
                   "layout, the same global batch and seed")
    g.add_argument("--init-from", default="", metavar="PATH",
                   help="start from these weights: a transformers save_pretrained directory "
                   "(its config.json is the model: --hf and sizes may be left out), a torch "
                   "state-dict or .safetensors file, or a meshplan checkpoint (weights only); "
                   "each rank reads only its own slices")
    g.add_argument("--export-hf", default="", metavar="DIR",
                   help="at the end, also write the trained transformers model (--hf) to the "
                   "new directory DIR for from_pretrained, as `meshplan export --format hf`")
    g.add_argument("--export-torch", default="", metavar="DIR",
                   help="at the end, also write the trained weights as torch state dicts to "
                   "the new directory DIR, as `meshplan export --format torch`")
    g.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    g.add_argument("--sample-tokens", type=int, default=120, metavar="N",
                   help="print N tokens the trained model writes after a validation prompt "
                   "(a masked or denoising model: its guesses at a validation sample's masked "
                   "tokens; 0: none)")
    g.add_argument("--mask-rate", type=float, default=0.15, metavar="R",
                   help="a masked LM (BERT's recipe) or an encoder-decoder (denoising): the "
                   "share of tokens masked for it to predict (default 0.15)")
    g.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="also write TensorBoard events (default: when tensorboard is installed)")
    add_config_file_flags(g)
    p.set_defaults(**MAIN_JOB)


def cmd_train(a: argparse.Namespace) -> int:
    """Plan, run and report one training run."""
    a = _resolved(a)
    _check(a)
    data_dir = a.data or default_corpus(a.progress)
    _pretrained(a)
    lm = _user_model(a, data_dir) if a.module else _language_model(a, data_dir)
    init_from = _init_source(a, lm) if a.init_from else ""
    _check_exports(a, lm)
    s = lm.job.strategy
    feed = TokenFeed(data_dir, "train", lm.seq_len, a.seed, lm.layout, mask_id=lm.mask_id,
                     mask_rate=a.mask_rate, pad_id=lm.pad_id, target_len=lm.target_len)
    eval_feed = replace(feed, split="validation", shuffle=False)
    if a.eval_every:
        _check_validation(eval_feed, a.eval_batches, s.global_batch_size)
    resume_from = _resume_point(a, lm.job, feed) if a.resume else ""
    _prepare_out(a, feed, s.global_batch_size)
    return _run(a, lm, feed, eval_feed, a.steps, data_dir, resume_from, init_from)


def _pretrained(a: argparse.Namespace) -> None:
    """`--init-from` a save_pretrained directory: the model is the one its
    config.json describes (`--hf`, if given, must name its type)."""
    a.source = None
    if a.init_from and is_pretrained_dir(a.init_from):
        if a.module:
            raise ConfigError(f"--init-from {a.init_from} is a transformers model; leave "
                              "--module out (its config.json says what the model is)")
        a.source = a.init_from
        if not a.hf:
            a.model = "hf:"


def _init_source(a: argparse.Namespace, lm) -> str:
    """The checked source of the starting weights (one line if they do not fit)."""
    return weight_source(a.init_from, lm.job, "model." if isinstance(lm.module, HFLoss) else "")


def _language_model(a: argparse.Namespace, data_dir: str):
    """A zoo or transformers model sized from the data, and its Jobs."""
    cfg = sized_config(a.model, a.size, data_dir, overrides(a))
    a.model = cfg.model  # hf:<type>, when --init-from's config said it
    if not getattr(a, "source", None):
        a.vocab = cfg.vocab  # the data's, for --auto's search too
    strategy = strategy_of(a, cfg)
    _steps_of(a, strategy.global_batch_size, cfg.seq_len)
    return language_model(a.model, a.size, data_dir, mesh_of(a), strategy,
                          optimizer_config(a), a.seed, overrides(a))


def _user_model(a: argparse.Namespace, data_dir: str):
    """The user's module (`--module`), and its Jobs."""
    sized = sorted(k for k in overrides(a) if k != "seq_len")
    if sized:
        flag = {"packed": "pack"}.get(sized[0], sized[0]).replace("_", "-")
        raise ConfigError(f"--module {a.module}: --{flag} shapes a model meshplan builds (--hf, "
                          "--model), and your factory builds this one: leave it out")
    fields = strategy_fields(a)
    fields.setdefault("layer_pattern", DERIVED)
    if a.tp > 1:
        fields.setdefault("tp_plan", DERIVED)
    seq_len = a.seq_len or 128
    _steps_of(a, fields["global_batch_size"], seq_len)
    return user_model(a.module, data_dir, seq_len, mesh_of(a), Strategy(**fields),
                      optimizer_config(a), a.seed)


def _steps_of(a: argparse.Namespace, global_batch_size: int, seq_len: int) -> None:
    """`--tokens N` as steps (before the optimizer's schedule is made of them)."""
    if a.tokens:
        a.steps = tokens_to_steps(a.tokens, global_batch_size, seq_len)


def _run(a, lm, feed, eval_feed, steps: int, data_dir: str, resume_from: str = "",
         init_from: str = "") -> int:
    record = _record(a, lm, data_dir)
    run = dict(eval_data=eval_feed, eval_every=a.eval_every, eval_batches=a.eval_batches,
               threads=a.threads, checkpoint_every=a.checkpoint_every,
               async_checkpoint=a.async_checkpoint, init_from=init_from,
               timeout_s=train_timeout(a.stall_timeout, a.kernels), stall_s=a.stall_timeout,
               device=a.device, backend=a.backend, kernels=a.kernels)
    with a.progress.task("training steps", steps) as update:
        if under_torchrun():  # this process is one rank; global rank 0 reports
            r = train_here(lm.job, _weights(lm.module), feed, steps, a.out, eval_job=lm.eval_job,
                           keep=a.keep, tensorboard=a.tensorboard, on_step=update,
                           record=record, resume_from=resume_from, **run)
            if r is None:
                return 0
        else:
            r = train_job(lm.job, _weights(lm.module), feed, steps, a.out,
                          eval_job=lm.eval_job, keep=a.keep, resume_from=resume_from,
                          max_restarts=a.max_restarts, tensorboard=a.tensorboard,
                          on_step=update, record=record, **run)
    lm.module.load_state_dict(r.weights, strict=False)  # every name, a tied one's aliases too
    weights = write_weights(r.weights, a.out)
    exports = _export(a, r.weights, record)
    entropy = unigram_entropy(data_dir)
    history = read_metrics(Path(a.out) / "metrics.jsonl")  # the run as continued, resumes too
    draw_training(history, str(Path(a.out) / "loss.png"), reference=entropy,
                  reference_label="unigram entropy")
    summary = {"steps": steps, "wall_s": r.wall_s,
               "losses": [x["loss"] for x in history if x["kind"] == "train"],
               "evals": [(x["step"], x["eval_loss"]) for x in history if x["kind"] == "eval"],
               "unigram_entropy": entropy, "weights": str(weights), "out": a.out,
               "tokens_per_s": median([m["tokens_per_s"] for m in r.metrics] or [0.0]),
               "mfu_of": peak_capacity(a.device, lm.job.mesh.world, a.threads)[1],
               "mfu": median([m["mfu"] for m in r.metrics] or [0.0]), "exports": exports}
    if Layout(feed.layout) in PAIRED:
        summary["cut"] = pair_cuts(feed)
    if Layout(feed.layout) in PACKED:
        summary["packed"] = pack_fill(feed)
    if a.sample_tokens and Layout(feed.layout) in PAIRED and _can_generate(lm.module):
        summary["answer"] = answer_sample(lm.module, feed, a.sample_tokens)
    elif a.sample_tokens and feed.mask_id >= 0:
        summary["fill"] = fill_sample(lm.module, feed)
    elif a.sample_tokens and _can_generate(lm.module):
        prompt, text = sample_text(lm.module, data_dir, lm.seq_len, a.sample_tokens, a.seed)
        summary["sample"] = {"prompt": prompt, "continuation": text}
    if a.json:
        print(json.dumps(summary))
        return 0
    print_summary(summary)
    return 0


def _can_generate(module) -> bool:
    """Whether the summary can sample `module`: a zoo model or a transformers one."""
    return hasattr(module, "logits") or hasattr(module, "model")


def _record(a: argparse.Namespace, lm, data_dir: str) -> dict:
    """What each checkpoint says of the model (`driver/model_record.py`): a
    saved transformers model's own config.json, as it was given."""
    return model_record(lm.job, lm.module, f"module:{a.module}" if a.module else a.model,
                        data_dir, saved_config(a.source) if a.source else None)


def print_summary(s: dict) -> None:
    """The lines a run ends with (its `--json` summary, for people)."""
    if s["losses"]:
        first, last = s["losses"][0], s["losses"][-1]
        print(f"trained {s['steps']} steps in {s['wall_s']:.0f} s: loss {first:.4f} -> "
              f"{last:.4f}; {s['tokens_per_s']:.0f} tokens/s, MFU {s['mfu']:.1%} (of "
              f"{s['mfu_of']}'s peak)")
    if s["evals"]:
        (k0, e0), (k1, e1) = s["evals"][0], s["evals"][-1]
        print(f"eval loss {e0:.4f} at step {k0} -> {e1:.4f} at step {k1} (perplexity "
              f"{perplexity(e1):.2f}; {1 - e1 / e0:.0%} lower); unigram entropy "
              f"{s['unigram_entropy']:.4f}")
    print(f"wrote {s['out']}/: metrics.jsonl, loss.png, config.toml, {Path(s['weights']).name}")
    for line in s.get("exports", []):
        print(line)
    if "sample" in s:
        print("sample (prompt, then the model's continuation):")
        print(s["sample"]["prompt"] + "\u2502" + s["sample"]["continuation"])
    if "cut" in s:
        c = s["cut"]
        print("pairs cut to fit a row: " + (
            f"{c['pairs']:.1%} (source and target longer than the row)" if "pairs" in c else
            f"{c['sources']:.1%} of sources (--seq-len), {c['targets']:.1%} of targets "
            "(--target-len)"))
    if "packed" in s:
        print(f"pairs packed: {s['packed']['pairs_per_row']:.2f} a row, "
              f"{s['packed']['filled']:.1%} of the row's positions real tokens")
    if "answer" in s:
        print("sample (a validation pair: its source, the model's answer, the target):")
        for key in ("source", "answer", "target"):
            print(f"  {key}: {s['answer'][key]}")
    if "fill" in s:
        f = s["fill"]
        print(f"sample (a validation sample, masked as in training; the model's guess at each "
              f"of its {f['masked']} masked tokens in [brackets], {f['right']} right):")
        print(f["text"])


def _check_exports(a: argparse.Namespace, lm) -> None:
    """--export-hf/--export-torch, checked before the run: one line if not."""
    if a.export_hf and not isinstance(lm.module, HFLoss):
        what = f"--module {a.module}" if a.module else f"--model {a.model}"
        raise ConfigError(f"--export-hf {a.export_hf}: {what} is not a transformers model; "
                          "use --export-torch, or train with --hf TYPE")
    if a.export_hf and a.export_hf == a.export_torch:
        raise ConfigError(f"--export-hf and --export-torch are both {a.export_hf}; give each "
                          "its own directory")
    for flag, out in (("--export-hf", a.export_hf), ("--export-torch", a.export_torch)):
        if out:
            try:
                check_out(out)
            except ConfigError as e:
                raise ConfigError(f"{flag}: {e}") from None


def _export(a: argparse.Namespace, weights: dict, record: dict) -> list[str]:
    """The --export-* directories, written from the weights in memory."""
    lines = []
    for fmt, out in ((ExportFormat.HF, a.export_hf), (ExportFormat.TORCH, a.export_torch)):
        if out:
            r = export(memory_source(weights, record), fmt, out)
            lines.append(export_lines("the trained weights", fmt.value, r))
    return lines


def _weights(module) -> dict:
    return weights_of(module)


def _resolved(a: argparse.Namespace) -> argparse.Namespace:
    """The flags with `--config FILE.toml` and `--set` applied (a flag on the
    command line wins over --set, which wins over the file)."""
    path = a.config if a.config and is_config_file(a.config) else None
    if path is None and not a.set:
        return a
    argv = a.argv[a.argv.index("train") + 1:]
    b = resolve(a.flag_parser, argv, path, a.set)
    for key in ("progress", "argv", "run", "quiet", "debug", "verbose"):
        if hasattr(a, key):
            setattr(b, key, getattr(a, key))
    b.config = None
    return b


def _check(a: argparse.Namespace) -> None:
    for flag, value in (("--eval-every", a.eval_every), ("--eval-batches", a.eval_batches),
                        ("--checkpoint-every", a.checkpoint_every), ("--keep", a.keep),
                        ("--max-restarts", a.max_restarts)):
        if value < 0:
            raise ConfigError(f"{flag} {value} must be >= 0")

    if a.max_restarts and under_torchrun():
        raise ConfigError(f"--max-restarts {a.max_restarts} restarts local ranks; under "
                          "torchrun give torchrun's own --max-restarts")
    if a.max_restarts and not a.checkpoint_every:
        raise ConfigError(f"--max-restarts {a.max_restarts} restarts from checkpoints: give "
                          "--checkpoint-every N too")
    if a.tokens is not None and a.tokens < 1:
        raise ConfigError(f"--tokens {a.tokens} must be a positive number of tokens")
    if a.steps < 0:
        raise ConfigError(f"--steps {a.steps} must be >= 0 (0: evaluate and export only)")
    if a.steps == 0:
        a.lr_schedule = "constant"  # no step is taken: no schedule to check
    if not 0 < a.mask_rate < 1:
        raise ConfigError(f"--mask-rate {a.mask_rate} must be between 0 and 1, e.g. "
                          "--mask-rate 0.15")
    if not a.stall_timeout > 0:
        raise ConfigError(f"--stall-timeout {a.stall_timeout} must be a positive number of "
                          "seconds, e.g. --stall-timeout 300")


def _check_validation(feed, batches: int, gbs: int) -> None:
    n = FeedReader(feed, gbs, 1).samples()
    if n < batches * gbs:
        raise ConfigError(f"the validation split of {feed.data_dir} has {n} "
                          f"{'rows of pairs' if feed.layout in PAIRED else 'samples'} of "
                          f"seq_len {feed.seq_len}; --eval-batches {batches} x global batch "
                          f"{gbs} needs {batches * gbs}. Lower --eval-batches, or prepare the "
                          "data with a larger --val-fraction")


def _prepare_out(a: argparse.Namespace, feed, global_batch_size: int) -> None:
    """The run's directory, with the resolved config written first, and what
    a resume must match (`run.json`: the data order's seed and batch)."""
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {a.out} is a file; give a directory for the run")
    out.mkdir(parents=True, exist_ok=True)
    write_resolved(a.flag_parser, a, str(out / "config.toml"))
    write_atomic(out / RUN_FILE, json.dumps(_run_identity(feed, global_batch_size)).encode())


RUN_FILE = "run.json"  # what a resumed run must share with the first: its data order


def _run_identity(feed, global_batch_size: int) -> dict:
    return {"seed": feed.seed, "global_batch_size": global_batch_size,
            "seq_len": feed.seq_len, "packed": Layout(feed.layout) in PACKED,
            "data": str(Path(feed.data_dir).resolve())}


def _resume_point(a: argparse.Namespace, job, feed) -> str:
    """The complete checkpoint `--resume` names, checked against the Job
    (its model) and against the first run's data order (one line if not)."""
    where = Path(a.out if a.resume == "latest" else a.resume)
    if (where / COMPLETE).is_file():
        point = where
    else:
        found = complete_checkpoints(where / CHECKPOINTS) or complete_checkpoints(where)
        if not found:
            raise ConfigError(f"--resume: no complete checkpoint under {where} (a run saves "
                              "them with --checkpoint-every N); start without --resume")
        point = found[-1]
    step = check_resumable(str(point), job)
    first = point.parent.parent / RUN_FILE
    if first.is_file():
        was, now = json.loads(first.read_text()), _run_identity(feed, job.strategy
                                                                 .global_batch_size)
        for key in ("global_batch_size", "seed", "seq_len", "packed"):
            if was.get(key, False) != now[key]:  # a run.json before --pack: not packed
                if key == "packed":
                    raise ConfigError(f"--resume {point}: that run read its pairs "
                                      f"{'packed' if was.get(key) else 'one a row'}, this one "
                                      f"{'packed' if now[key] else 'one a row'}; resume "
                                      f"{'with' if was.get(key) else 'without'} --pack, so the "
                                      "data goes on where it stopped")
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"--resume {point}: that run read its data with {key} "
                                  f"{was[key]}, this one {now[key]}; resume with {flag} "
                                  f"{was[key]}, so the data goes on where it stopped")
    if step >= a.steps:
        raise ConfigError(f"--resume {point}: it is already {step} steps into the run and "
                          f"--steps is {a.steps}; raise --steps to train further")
    return str(point)


def default_corpus(progress) -> str:
    """The main job's data: the standard library's sources as byte tokens,
    prepared once under `$MESHPLAN_HOME/data/stdlib-bytes`."""
    out = Path(meshplan_home()) / "data" / "stdlib-bytes"
    if (out / "index.json").is_file():
        return str(out)
    files = stdlib_files()
    print(f"preparing the main job's data: {len(files)} standard-library sources -> {out}",
          file=sys.stderr)
    with progress.task("files", len(files)) as update:
        prepare_data(files, str(out), "bytes", 0.02, progress=lambda done, total: update(done))
    return str(out)
