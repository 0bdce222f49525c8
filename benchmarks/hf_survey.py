"""Every causal-LM, masked-LM and encoder-decoder LM model type of the installed transformers,
tried as a user would: `meshplan verify --hf TYPE --steps 2` (one rank, fp32),
each in a fresh process. Writes benchmarks/results/hf_survey.{json,md}: per
type, equal to eager, refused with one line (the line), or a traceback.

    python benchmarks/hf_survey.py [--jobs 2] [--timeout 300] [TYPE ...]
    python benchmarks/hf_survey.py --again TYPE ...   # measure these anew, keep the rest
    python benchmarks/hf_survey.py --render           # the tables from hf_survey.json
    python benchmarks/hf_survey.py --layout tp2pp2    # the types equal at one rank, at a layout

Each row names the meshplan commit it was measured at. A layout's survey
writes hf_survey_LAYOUT.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LAYOUTS = {"1": (), "dp2": ("--devices-per-node", "2", "--dp", "2"),
           "tp2pp2": ("--devices-per-node", "4", "--tp", "2", "--pp", "2"),
           "dp2tp2": ("--devices-per-node", "4", "--dp", "2", "--tp", "2")}


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)
                  | set(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES))


def try_type(name: str, timeout: float, layout: tuple[str, ...] = ()) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "meshplan", "verify", "--hf", name, "--steps", "2", *layout,
           "--json"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"type": name, "outcome": "timeout", "line": f"over {timeout:.0f} s",
                "s": timeout}
    err = p.stderr.strip().splitlines()
    out = {"type": name, "rc": p.returncode, "s": round(time.perf_counter() - t0, 1)}
    if p.returncode < 0:
        return out | {"outcome": "killed", "line": f"killed by signal {-p.returncode}"}
    if "Traceback (most recent call last)" in p.stderr:
        return out | {"outcome": "traceback", "line": err[-1] if err else ""}
    if p.returncode == 0:
        r = json.loads(p.stdout)
        return out | {"outcome": "equal", "max_abs_diff": r["max_abs_diff"]}
    if p.returncode == 1 and p.stdout.strip().startswith("{"):
        r = json.loads(p.stdout)
        return out | {"outcome": "mismatch", "line": "; ".join(r["problems"][:2])}
    line = next((x for x in err if x.startswith("meshplan: error:")), err[-1] if err else "")
    return out | {"outcome": "refused", "line": line.removeprefix("meshplan: error: ")}


# Why a type is refused, by the first pattern its line matches (the README's list)
CLASSES = (
    ("a config field not sized", r"at these sizes"),
    ("the config rejects the sizes", r"offline from its config"),
    ("no language-model head", r"has no causal-LM"),
    ("torch.export fails", r"torch\.export failed"),
    ("an op or value meshplan cannot capture", r"cannot capture|neither an aten op|unsupported"),
    ("the layers do not form pp stages", r"equal segments|not contiguous"),
)


def refusal_class(line: str) -> str:
    return next((name for name, rx in CLASSES if re.search(rx, line)), "other")


def by_class(rows: list[dict]) -> list[str]:
    """Markdown: each refusal class, its types and one line a user sees."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["outcome"] == "refused":
            groups.setdefault(refusal_class(r.get("line", "")), []).append(r)
    out = ["| class | types | e.g. the line of the first |", "|---|---|---|"]
    for name, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        types = ", ".join(f"`{r['type']}`" for r in rs)
        out.append(f"| {name} ({len(rs)}) | {types} | {rs[0].get('line', '').replace('|', '/')} |")
    return out


README = Path(__file__).parents[1] / "README.md"
MARKS = ("<!-- hf-refused -->", "<!-- /hf-refused -->")


def _readme(rows: list[dict], counts: dict) -> None:
    """The README's list of refused families: this survey's, between MARKS."""
    text = README.read_text()
    if MARKS[0] not in text:
        return
    head, rest = text.split(MARKS[0], 1)
    tail = rest.split(MARKS[1], 1)[1]
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    block = [f"Of {len(rows)} types: {summary}. Refused, by class (each row: the line a user "
             "sees for the first of its types):", "", *by_class(rows)]
    README.write_text(head + MARKS[0] + "\n" + "\n".join(block) + "\n" + MARKS[1] + tail)


def _commit() -> str:
    p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=Path(__file__).parent)
    return p.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--again", action="store_true",
                    help="measure the TYPEs anew and keep the other rows of hf_survey.json")
    ap.add_argument("--render", action="store_true",
                    help="write hf_survey.md and the README's list from hf_survey.json only")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="1",
                    help="verify at this layout the types equal at one rank (hf_survey.json)")
    a = ap.parse_args()
    import transformers

    stem = "hf_survey" if a.layout == "1" else f"hf_survey_{a.layout}"
    partial = RESULTS / f"{stem}.partial.jsonl"  # one row per type as it finishes
    layout = LAYOUTS[a.layout]
    universe = model_types() if a.layout == "1" else [  # at a layout: those equal at one
        r["type"] for r in json.loads((RESULTS / "hf_survey.json").read_text())["rows"]
        if r["outcome"] == "equal"]
    names = universe if a.again or not a.types else a.types
    RESULTS.mkdir(exist_ok=True)
    done = {}  # rows already measured (a survey cut short goes on where it stopped)
    if a.again:
        old = json.loads((RESULTS / f"{stem}.json").read_text())["rows"]
        done = {r["type"]: r for r in old if r["type"] not in a.types}
    if partial.is_file():
        done |= {r["type"]: r for r in map(json.loads, partial.read_text().splitlines())}

    commit = _commit()

    def one(name: str) -> dict:
        if name in done:
            return done[name]
        r = try_type(name, a.timeout, layout) | {"commit": commit}
        with partial.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{r['type']:<28} {r['outcome']:<9} {r.get('line', '')[:150]}", flush=True)
        return r

    if a.render:
        rows = json.loads((RESULTS / f"{stem}.json").read_text())["rows"]
    else:
        with ThreadPoolExecutor(a.jobs) as pool:
            rows = list(pool.map(one, names))
    command = " ".join(("meshplan verify --hf TYPE --steps 2", *layout, "--json"))
    data = {"transformers": transformers.__version__, "command": command, "rows": rows}
    (RESULTS / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    counts = {k: sum(r["outcome"] == k for r in rows)
              for k in ("equal", "mismatch", "refused", "traceback", "timeout", "killed")}
    lines = [f"# transformers {transformers.__version__}: every causal-LM, masked-LM and "
             "encoder-decoder LM model type" + ("" if a.layout == "1" else
                                                 f" equal at one rank, at {a.layout}"),
             "", f"`{command}`, {'one rank' if a.layout == '1' else a.layout}, fp32, each "
             "in a fresh process (`benchmarks/hf_survey.py`); each row at the meshplan commit "
             "it names.", "",
             ", ".join(f"{v} {k}" for k, v in counts.items()), "",
             "## Refused, by class", "", *by_class(rows), "", "## Every type", "",
             "| type | outcome | what the user sees | commit |", "|---|---|---|---|"]
    lines += [f"| `{r['type']}` | {r['outcome']} | {r.get('line', '').replace('|', '/')} | "
              f"{r.get('commit', '')} |" for r in rows]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    if a.layout == "1":
        _readme(rows, counts)
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
