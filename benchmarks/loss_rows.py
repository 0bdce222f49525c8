"""What a step's loss is where labels are ignored (docs/concepts/train.md,
"A step's loss"): BERT tiny (its masked LM), global batch 8, 2 SGD steps
through `verify`, at layouts whose micro-batches hold 1, 2, 4 and 8 rows
(micro-batch size x dp). Each layout's losses are meshplan's ranks', and
each run is judged against eager on the same micro-batches (`ok`).

`python benchmarks/loss_rows.py` writes `results/loss_rows.{json,md}`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from meshplan.driver.plan import zoo_strategy  # noqa: E402
from meshplan.driver.verify import verify  # noqa: E402
from meshplan.ir.mesh import Mesh  # noqa: E402
from meshplan.models import model_config  # noqa: E402

LAYOUTS = [(1, 1), (1, 2), (2, 1), (4, 1), (1, 8), (2, 4)]  # (dp, micro-batch size)


def main() -> None:
    rows = []
    for dp, micro in LAYOUTS:
        s = zoo_strategy("bert", model_config("bert", "tiny"), dp=dp, global_batch_size=8,
                         micro_batch_size=micro)
        r = verify("bert", "tiny", steps=2, global_batch_size=8, mesh=Mesh(1, dp), strategy=s)
        rows.append({"dp": dp, "micro_batch_size": micro, "rows": dp * micro,
                     "losses": r["losses"], "ref_losses": r["ref_losses"], "ok": r["ok"]})
        print(rows[-1], flush=True)
    lines = ["# A step's loss by the rows a micro-batch holds (BERT tiny, masked LM)", "",
             "`python benchmarks/loss_rows.py`: global batch 8, 2 SGD steps, the same weights "
             "and samples; meshplan's losses, each run judged against eager on its own "
             "micro-batches.", "",
             "| dp | micro-batch size | rows per micro-batch | step-0 loss | step-1 loss | "
             "verify |", "|---|---|---|---|---|---|"]
    lines += [f"| {x['dp']} | {x['micro_batch_size']} | {x['rows']} | {x['losses'][0]:.6f} | "
              f"{x['losses'][1]:.6f} | {'OK' if x['ok'] else 'FAIL'} |" for x in rows]
    common.write("loss_rows", {"machine": common.machine(), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
