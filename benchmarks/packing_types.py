"""Which transformers causal LMs `train --pack` takes: every causal type the
survey judged equal (benchmarks/hf_survey.json), built tiny, through the
check a packed run makes before it starts (`driver/train_model._check_packing`:
a pair's logits packed after another equal its logits alone).

    python benchmarks/packing_types.py

Writes benchmarks/results/packing_types.{json,md}.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    from meshplan.driver.train_model import _check_packing
    from meshplan.errors import ConfigError
    from meshplan.models import build_model, model_config
    from meshplan.models.hf import CAUSAL, task_of

    warnings.filterwarnings("ignore")
    survey = json.loads((RESULTS / "hf_survey.json").read_text())["rows"]
    out: dict[str, list[str]] = {"packs": [], "refused": [], "error": []}
    for row in (r for r in survey if r["outcome"] == "equal"):
        name = row["type"]
        try:
            cfg = model_config(f"hf:{name}", "tiny", vocab=257)
            if task_of(cfg) != CAUSAL:
                continue
            torch.manual_seed(0)
            _check_packing(build_model(cfg), name)
            out["packs"].append(name)
        except ConfigError:
            out["refused"].append(name)
        except Exception as e:  # noqa: BLE001 - listed, not hidden
            out["error"].append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
        print(name, next(k for k, v in out.items() if v and v[-1].startswith(name)), flush=True)
    (RESULTS / "packing_types.json").write_text(json.dumps(out, indent=1) + "\n")
    total = sum(map(len, out.values()))
    lines = ["# `train --pack`: which causal types pack", "",
             f"Of the survey's {total} causal LM types judged equal, built tiny: "
             f"{len(out['packs'])} keep each packed pair to itself and pack; "
             f"{len(out['refused'])} attend across pairs and are refused in one line; "
             f"{len(out['error'])} failed the check otherwise (`benchmarks/packing_types.py`).",
             "", "Refused (state-space and linear-attention layers, ALiBi, learned or "
             "relative positions that ignore position ids, cross-attention to images):", "",
             ", ".join(f"`{t}`" for t in out["refused"]), "", "Pack:", "",
             ", ".join(f"`{t}`" for t in out["packs"])]
    if out["error"]:
        lines += ["", "Errors:", "", *(f"- {e}" for e in out["error"])]
    (RESULTS / "packing_types.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
