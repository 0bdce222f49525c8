"""Job digests of a fixed set of configurations, for refactors that must not
change a Job: `python benchmarks/job_digests.py [--big] > out.json`, then
compare with `tests/goldens/job_digests.json` (the cheap set is also a test:
tests/passes/test_job_digests.py). `--big` adds GPT-3 175B at 128 ranks
(tp8 pp16 vpp2 dp1, about a minute on 2 cores)."""

from __future__ import annotations

import json
import sys

CASES = {
    # name: (model, size, nodes, devices_per_node, strategy fields, optimizer, overrides)
    "gpt-1": ("gpt", "tiny", 1, 1, {"global_batch_size": 4, "micro_batch_size": 2}, "sgd", {}),
    "gpt-dp2-tp2-pp2-vpp2": ("gpt", "tiny", 1, 8, {"dp": 2, "tp": 2, "pp": 2, "vpp": 2,
                             "global_batch_size": 8, "micro_batch_size": 1,
                             "schedule": "interleaved"}, "adamw", {}),
    "gpt-pp2-gpipe": ("gpt", "tiny", 1, 2, {"pp": 2, "global_batch_size": 4,
                      "schedule": "gpipe"}, "sgd", {}),
    "gpt-pp2-1f1b-recompute": ("gpt", "tiny", 1, 2, {"pp": 2, "global_batch_size": 4,
                               "recompute": "full"}, "sgd", {}),
    "gpt-pp2-zb1p": ("gpt", "tiny", 1, 2, {"pp": 2, "global_batch_size": 4,
                     "schedule": "zb1p"}, "adamw", {}),
    "gpt-pp2-zbv": ("gpt", "tiny", 1, 2, {"pp": 2, "vpp": 2, "global_batch_size": 4,
                    "schedule": "zbv"}, "adamw", {}),
    "gpt-dp2-zero1": ("gpt", "tiny", 1, 2, {"dp": 2, "global_batch_size": 4, "zero": 1},
                      "adamw", {}),
    "gpt-dp2-zero2": ("gpt", "tiny", 1, 2, {"dp": 2, "global_batch_size": 4, "zero": 2},
                      "adamw", {}),
    "gpt-dp2-pp2-zero3": ("gpt", "tiny", 1, 4, {"dp": 2, "pp": 2, "global_batch_size": 4,
                          "zero": 3}, "adamw", {}),
    "gpt-tp2-bf16": ("gpt", "tiny", 1, 2, {"tp": 2, "global_batch_size": 2,
                     "precision": "bf16"}, "adamw", {}),
    "gpt-tp2-fp16": ("gpt", "tiny", 1, 2, {"tp": 2, "global_batch_size": 2,
                     "precision": "fp16"}, "adamw", {}),
    "gpt-dp2-dropout": ("gpt", "tiny", 1, 2, {"dp": 2, "global_batch_size": 4}, "adamw",
                        {"dropout": 0.1}),
    "bert-tp2-pp2": ("bert", "tiny", 1, 4, {"tp": 2, "pp": 2, "global_batch_size": 4},
                     "adamw", {}),
    "resnet-dp2": ("resnet", "tiny", 1, 2, {"dp": 2, "global_batch_size": 4}, "sgd", {}),
    "hf-llama-tp2-pp2": ("hf:llama", "tiny", 1, 4, {"tp": 2, "pp": 2, "global_batch_size": 4},
                         "adamw", {}),
}
BIG = {
    "gpt3-175b-128": ("gpt", "gpt3-175b", 16, 8, {"tp": 8, "pp": 16, "vpp": 2, "dp": 1,
                      "global_batch_size": 64, "micro_batch_size": 1,
                      "schedule": "interleaved"}, "adamw", {}),
}


def digest(model, size, nodes, per_node, fields, optimizer, overrides) -> str:
    from meshplan.driver.plan import plan_model, zoo_strategy
    from meshplan.ir.mesh import Mesh
    from meshplan.models import model_config

    cfg = model_config(model, size, **overrides)
    strategy = zoo_strategy(model, cfg, **fields)
    return plan_model(model, size, Mesh(nodes, per_node), strategy, optimizer,
                      **overrides).job.digest()


def main(argv: list[str]) -> None:
    cases = dict(CASES, **(BIG if "--big" in argv else {}))
    print(json.dumps({name: digest(*c) for name, c in cases.items()}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
