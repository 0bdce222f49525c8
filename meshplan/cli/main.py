"""The `meshplan` command: one verb per sub-command.

Invariant: a `MeshplanError` prints one line `meshplan: error: ...` to stderr
and exits 2 with no traceback (unless `--debug`); nothing is left half-written.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from contextlib import contextmanager

from meshplan.cli.auto_cmd import print_table, run_search, strategy_of, table_json
from meshplan.cli.calibrate_cmd import EPILOG as EPILOG_CALIBRATE
from meshplan.cli.calibrate_cmd import (
    EPILOG_DEVICES,
    add_calibrate_flags,
    add_devices_flags,
    cmd_calibrate,
    cmd_devices,
)
from meshplan.cli.compile_cmds import cmd_check, cmd_compile
from meshplan.cli.data_cmd import EPILOG as EPILOG_PREPARE
from meshplan.cli.data_cmd import add_prepare_flags, cmd_prepare_data
from meshplan.cli.demo_cmd import EPILOG as EPILOG_DEMO
from meshplan.cli.demo_cmd import add_demo_flags, cmd_demo
from meshplan.cli.export_cmd import EPILOG as EPILOG_EXPORT
from meshplan.cli.export_cmd import add_export_flags, cmd_export
from meshplan.cli.flags import (
    add_device_flags,
    add_model_flags,
    add_optimizer_flags,
    add_training_flags,
    add_verb,
    apply_config,
    config_name_of,
    mesh_of,
    optimizer_config,
    overrides,
)
from meshplan.cli.progress import Progress
from meshplan.cli.run_cmd import cmd_run, loss_table
from meshplan.cli.show_cmd import cmd_show
from meshplan.cli.show_plan import print_plan
from meshplan.cli.train_cmd import EPILOG as EPILOG_TRAIN
from meshplan.cli.train_cmd import add_train_flags, cmd_train
from meshplan.cli.verdict import (
    add_reference_rng_flags,
    add_tolerance_flag,
    bounds_of,
    verdict_lines,
)
from meshplan.driver.inspect import inspect_model
from meshplan.driver.job_report import report
from meshplan.driver.plan import plan_model
from meshplan.driver.verify import verify
from meshplan.errors import ConfigError, MeshplanError
from meshplan.models import model_config
from meshplan.models.moe import capacity_words
from meshplan.runtime.devices import DEVICES

EPILOG_INSPECT = """examples:
  meshplan inspect --model gpt --size gpt3-175b
  meshplan inspect --model resnet --size resnet50 --json"""
EPILOG_PLAN = """examples:
  meshplan plan --model gpt --nodes 2 --devices-per-node 4 --tp 2 --pp 2 --vpp 2 \\
      --global-batch-size 16 --micro-batch-size 2
  meshplan plan --model gpt --size gpt3-175b --nodes 128 --devices-per-node 8 \\
      --tp 8 --pp 16 --vpp 2 --num-microbatches 64 --json"""
EPILOG_COMPILE = """examples:
  meshplan compile --model gpt --nodes 2 --devices-per-node 4 --tp 2 --pp 2 --vpp 2 \\
      --num-microbatches 8 --out plans/
  meshplan compile --model gpt --size gpt3-175b --nodes 512 --devices-per-node 8 --tp 8 \\
      --pp 16 --vpp 2 --num-microbatches 64 --ranks 0,17 --out big/ --json"""
EPILOG_RUN = """examples:
  meshplan run --model gpt --devices-per-node 4 --tp 2 --pp 2 --num-microbatches 4 --steps 10
  meshplan run --config bert_nl4_nah4_hs64_FP16_actrue_mp2_pp1_mb4_gb8_1n4g --steps 10
  torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr HOST --master-port 29500 \\
      -m meshplan run --model gpt --nodes 2 --devices-per-node 4 --tp 2 --pp 2 --json
  meshplan run --model gpt --devices-per-node 2 --pp 2 --vpp 2 --num-microbatches 4 \\
      --steps 3 --trace step.json"""
EPILOG_SHOW = """examples:
  meshplan show plans/
  meshplan show plans/ --rank 5 --trace step.json
  meshplan show plans/ --png schedule.png --json
  meshplan show plans/ --csv schedule.csv"""
EPILOG_CHECK = """examples:
  meshplan check plans/
  meshplan check plans/ --json"""
EPILOG_VERIFY = """examples:
  meshplan verify --model gpt --size tiny
  meshplan verify --model bert --size tiny --steps 20 --optimizer adamw --json
  meshplan verify --model gpt --size tiny --global-batch-size 8 --num-microbatches 4
  meshplan verify --model gpt --devices-per-node 4 --tp 2 --pp 2 --num-microbatches 4
  meshplan verify --config gpt_nl4_nah4_hs64_BF16_actrue_mp2_pp1_mb2_gb16_1n4g --steps 20"""


class _Parser(argparse.ArgumentParser):
    """argparse, with a flag mistake raised as a `ConfigError`, so it is one
    line (exit 2) like every other user error, not the usage block."""

    def error(self, message: str):
        raise ConfigError(f"{message}; see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="meshplan", description="A distributed-training compiler for PyTorch.")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks on errors, and check the IR's invariants after "
                        "every compile pass")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="errors only: no progress bars, no logging below ERROR")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = add_verb(sub, "demo", "the main job end to end on 8 local processes: compile, check, "
                 "train beside eager PyTorch, draw the schedule and losses, write a trace",
                 EPILOG_DEMO, cmd_demo, planning=False)
    add_demo_flags(p)

    p = add_verb(sub, "train", "train a language model on a prepared token directory: "
                 "metrics, evaluation, loss.png and the trained weights (no arguments: the "
                 "main job)", EPILOG_TRAIN, cmd_train)
    add_training_flags(p, steps=160)
    add_device_flags(p)
    add_train_flags(p)

    p = add_verb(sub, "prepare-data", "turn text files (or JSONL, or a local datasets "
                 "directory) into a token directory for `meshplan train`", EPILOG_PREPARE,
                 cmd_prepare_data, planning=False, json_help="print the index as JSON")
    add_prepare_flags(p)

    p = add_verb(sub, "export", "write a checkpoint's weights for transformers "
                 "(from_pretrained) or torch (load_state_dict)", EPILOG_EXPORT, cmd_export,
                 planning=False, json_help="print what was written as JSON")
    add_export_flags(p)

    p = add_verb(sub, "inspect", "capture a model on the meta device and count it",
                 EPILOG_INSPECT, _cmd_inspect, planning=False)
    add_model_flags(p)

    p = add_verb(sub, "verify", "train with eager PyTorch and meshplan; compare every loss, "
                 "parameter and optimizer slot", EPILOG_VERIFY, _cmd_verify)
    add_training_flags(p, steps=20)
    add_device_flags(p)
    add_tolerance_flag(p)
    add_reference_rng_flags(p)

    p = add_verb(sub, "plan", "plan a model on a mesh and print the Job summary",
                 EPILOG_PLAN, _cmd_plan)
    add_optimizer_flags(p)

    p = add_verb(sub, "compile", "compile one plan per rank, each rank in a worker",
                 EPILOG_COMPILE, cmd_compile, json_help="print the statistics as JSON")
    add_optimizer_flags(p)
    p.add_argument("--out", required=True, help="plan directory to write")
    p.add_argument("--ranks", default=None, help="lower only these ranks, e.g. 0,17 or 0-7")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: the number of cores)")
    p.add_argument("--no-cache", action="store_true", help="lower every rank afresh")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="device type to lower for (default cpu): it picks each task's "
                   "kernel, e.g. CUDA attention. Needs no GPU; auto: cuda when this machine "
                   "has one")

    p = add_verb(sub, "run", "train on one local process per rank (or under torchrun)",
                 EPILOG_RUN, cmd_run)
    add_training_flags(p, steps=10)
    add_device_flags(p)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds any collective may wait before the run fails (default 60; "
                        "900 with --kernels inductor, whose first step waits on the "
                        "peers' builds of their kernels on a cold cache)")
    p.add_argument("--plan-dir", default="", help="run plans written by `meshplan compile`")
    p.add_argument("--save-dir", default="", help="write a checkpoint there at the end")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in --save-dir (any parallel layout)")
    p.add_argument("--trace", default="",
                   help="write the last step, measured on every rank, as a Chrome trace")

    p = add_verb(sub, "show", "show a plan directory: ranks, pipeline grid, trace",
                 EPILOG_SHOW, cmd_show, planning=False)
    p.add_argument("dir", help="a directory written by `meshplan compile`")
    p.add_argument("--rank", type=int, default=None, help="only this rank")
    p.add_argument("--trace", default="", help="write a Chrome trace of the simulated step")
    p.add_argument("--png", default="", help="draw the simulated step: one row per rank, "
                   "F, B, I and W coloured by chunk, sends and receives marked, bubbles white")
    p.add_argument("--csv", default="", metavar="FILE",
                   help="write each pipeline rank's actions in torch's pipeline CSV format "
                   "(one row per rank; --schedule-csv reads it back)")
    p.add_argument("--csv-comm", action="store_true",
                   help="with --csv: include the SEND/RECV actions (torch's lowered form)")

    p = add_verb(sub, "check", "prove a plan directory consistent and simulate it",
                 EPILOG_CHECK, cmd_check, planning=False)
    p.add_argument("dir", help="a directory written by `meshplan compile`")

    p = add_verb(sub, "calibrate", "measure this machine (matmul, memory, gloo) and write "
                 "the cpu-local device model", EPILOG_CALIBRATE, cmd_calibrate, planning=False,
                 json_help="print the model and the raw measurements as JSON")
    add_calibrate_flags(p)

    p = add_verb(sub, "devices", "list the device models, or show one with its sources",
                 EPILOG_DEVICES, cmd_devices, planning=False)
    add_devices_flags(p)
    return parser


def _cmd_inspect(a: argparse.Namespace) -> int:
    r = inspect_model(a.model, a.size, **overrides(a))
    if a.json:
        print(json.dumps(r))
        return 0
    active = "" if r["active_numel"] is None else f", {r['active_numel']:,} active per token"
    print(f"{a.model} {a.size}: {r['ops']} ops, {r['params']} parameters "
          f"({r['param_numel']:,} elements{active}, {r['param_bytes'] / 2**30:.2f} GiB), "
          f"{r['layers']} layers, {r['buffers']} buffers")
    print(f"captured on the meta device in {r['capture_s']:.2f} s "
          f"(model built in {r['build_s']:.2f} s)")
    if r["generic_ops"]:
        print("ops on the generic rule: " + ", ".join(r["generic_ops"]))
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    # every flag goes through the plan's arithmetic and check (a layout the mesh cannot
    # hold is refused, as plan refuses it); verify runs one process with no plan only
    # where the strategy is one rank and one stage
    strategy = strategy_of(a, model_config(a.model, a.size, **overrides(a)))
    r = verify(a.model, a.size, steps=a.steps, optimizer=optimizer_config(a), seed=a.seed,
               mesh=mesh_of(a), strategy=strategy, lr=a.lr, bounds=bounds_of(a),
               device=a.device, run_options={"backend": a.backend, "kernels": a.kernels},
               reference_rng=a.reference_rng, ref_runs=a.ref_runs, **overrides(a))
    if a.json:
        print(json.dumps(r.to_json()))
        return 0 if r.ok else 1
    print(loss_table(r.ref_losses, r.losses))
    if r.details["mode"] == "distributed":
        n = len(r.details["ranks"])
        print(f"(meshplan ran on {n} local process{'es' if n > 1 else ''}, one per rank)")
    print(verdict_lines(r))
    print(f"step {r.details['step_s'] * 1e3:.1f} ms vs eager "
          f"{r.details['ref_step_s'] * 1e3:.1f} ms")
    return 0 if r.ok else 1


def _cmd_plan(a: argparse.Namespace) -> int:
    cfg = model_config(a.model, a.size, **overrides(a))
    if a.auto:
        res, dev, limit = run_search(a)
        t = table_json(a, cfg, res, dev, limit)
        print(json.dumps(t)) if a.json else print_table(t)
        return 0
    strategy = strategy_of(a, cfg)
    planned = plan_model(a.model, a.size, mesh_of(a), strategy, optimizer_config(a), a.lr,
                         **overrides(a))
    r = report(planned.job)
    if a.json:
        print(json.dumps(r.to_json() | {"capture_s": planned.capture_s,
                                        "passes_s": planned.timings}))
    else:
        bound = capacity_words(cfg.seq_len, cfg.experts, cfg.top_k, cfg.capacity_factor) \
            if cfg.model == "moe" else ""
        print_plan(r, a.model, a.size, planned.timings, planned.capture_s, bound)
    return 0


@contextmanager
def _checks_when(debug: bool):
    """With --debug, the pass manager's invariant checks (MESHPLAN_CHECKS=1)
    for this command and every rank it starts; the environment as it was after."""
    old = os.environ.get("MESHPLAN_CHECKS")
    if debug:
        os.environ["MESHPLAN_CHECKS"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MESHPLAN_CHECKS", None)
        else:
            os.environ["MESHPLAN_CHECKS"] = old


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `meshplan` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except ConfigError as e:
        if "--debug" in argv:
            raise
        print(f"meshplan: error: {e}", file=sys.stderr)
        return e.exit_code
    level = logging.ERROR if args.quiet else (logging.DEBUG if args.verbose > 1 else
                                              logging.INFO if args.verbose else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    args.progress = Progress(quiet=args.quiet)
    args.argv = argv
    with _checks_when(args.debug):
        if getattr(args, "hf", None):  # --hf gpt2 is the model hf:gpt2
            args.model = "hf:" + args.hf
        try:
            apply_config(args)
            if getattr(args, "print_config", False):
                print(config_name_of(args))
                return 0
            return args.run(args)
        except MeshplanError as e:
            if args.debug:
                raise
            print(f"meshplan: error: {e}", file=sys.stderr)
            return e.exit_code
        except OSError as e:  # a path that cannot be read or written: the user's to fix
            if args.debug:
                raise
            where = f" {e.filename}" if e.filename else ""
            print(f"meshplan: error: cannot use{where}: {e.strerror or e}; check the path and "
                  "its permissions", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("meshplan: interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
