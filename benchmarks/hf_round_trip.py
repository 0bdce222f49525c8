"""Every transformers type the survey judged equal (benchmarks/hf_survey.json),
trained and exported as a user would, then loaded by transformers:

1. `meshplan train --hf TYPE --size tiny` on byte data (the `json` package's
   sources), one rank, 2 steps, a checkpoint at step 2, `--export-hf A`;
2. `meshplan export RUN --format hf --out B` (the checkpoint);
3. in a fresh process, A and B loaded by their recorded class
   (`config.json`'s `architectures`) with `from_pretrained`: no key missing
   or unexpected, and every tensor of both equal to the run's weights
   (`model.safetensors`);
4. `meshplan train --init-from B --steps 0`: the new run's weights are the
   first run's (a masked LM is refused on byte data: it has no mask token).

Writes benchmarks/results/hf_round_trip.{json,md}; each row names the commit.

    python benchmarks/hf_round_trip.py [--jobs 1] [--timeout 600] [TYPE ...]
    python benchmarks/hf_round_trip.py --render   # the tables from the rows measured so far
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from hf_survey import _commit  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PARTIAL = RESULTS / "hf_round_trip.partial.jsonl"
STEPS = ["--size", "tiny", "--devices-per-node", "1", "--dp", "1", "--tp", "1", "--pp", "1",
         "--vpp", "1", "--steps", "2", "--checkpoint-every", "2", "--eval-every", "0",
         "--warmup-steps", "0", "--lr-schedule", "constant", "--sample-tokens", "0"]

LOAD = r'''
import json, sys, torch, transformers
from safetensors.torch import load_file
transformers.logging.set_verbosity_error()
run, dirs = sys.argv[1], sys.argv[2:]
prefix = json.load(open(f"{run}/model.json"))["prefix"]
weights = {k.removeprefix(prefix): v for k, v in load_file(f"{run}/model.safetensors").items()}
out = {}
if dirs[0].endswith("run2"):  # step 4: a run started from B, 0 steps
    again = load_file(f"{dirs[0]}/model.safetensors")
    differ = [k for k, v in weights.items() if not torch.equal(v, again[prefix + k])]
    print(json.dumps({"n_differ": len(differ), "differ": differ[:3]}))
    sys.exit(0)
for d in dirs:
    arch = json.load(open(f"{d}/config.json"))["architectures"][0]
    model, info = getattr(transformers, arch).from_pretrained(d, output_loading_info=True)
    bad = sorted(info["missing_keys"]) + sorted(info["unexpected_keys"])
    state = model.state_dict()
    differ = [k for k, v in state.items() if k in weights and not torch.equal(v, weights[k])]
    out[d] = {"class": arch, "bad_keys": bad[:3], "n_bad": len(bad), "differ": differ[:3],
              "n_differ": len(differ), "tensors": len(state)}
print(json.dumps(out))
'''


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _line(p: subprocess.CompletedProcess) -> str:
    err = p.stderr.strip().splitlines()
    return next((x for x in err if x.startswith("meshplan: error:")), err[-1] if err else "")


def try_type(name: str, data: str, timeout: float) -> dict:
    t0 = time.perf_counter()
    row: dict = {"type": name}
    with tempfile.TemporaryDirectory(prefix=f"rt-{name}-") as tmp:
        run, a, b = f"{tmp}/run", f"{tmp}/a", f"{tmp}/b"
        steps = [("train", [sys.executable, "-m", "meshplan", "-q", "train", "--hf", name, "--data",
                            data, "--out", run, *STEPS, "--export-hf", a]),
                 ("export", [sys.executable, "-m", "meshplan", "-q", "export", run,
                             "--format", "hf", "--out", b]),
                 ("load", [sys.executable, "-c", LOAD, run, a, b])]
        for what, cmd in steps:
            try:
                p = _run(cmd, timeout)
            except subprocess.TimeoutExpired:
                return row | {"outcome": f"{what} timeout", "s": timeout}
            if p.returncode != 0:
                trace = "Traceback (most recent call last)" in p.stderr
                return row | {"outcome": f"{what} {'traceback' if trace else 'refused'}",
                              "line": _line(p), "s": round(time.perf_counter() - t0, 1)}
        loaded = json.loads(p.stdout)
        row["init_from"] = _init_from(run, b, data, timeout)
    ok = all(v["n_bad"] == 0 and v["n_differ"] == 0 for v in loaded.values())
    first = loaded[a]
    return row | {"outcome": "loads equal" if ok else "mismatch", "class": first["class"],
                  "tensors": first["tensors"], "s": round(time.perf_counter() - t0, 1),
                  **({} if ok else {"line": json.dumps(loaded)[:300]})}


def _init_from(run: str, export: str, data: str, timeout: float) -> str:
    """Step 4: "equal", or what went wrong."""
    run2 = f"{run}2"
    cmd = [sys.executable, "-m", "meshplan", "-q", "train", "--init-from", export, "--data",
           data, "--out", run2, *STEPS[2:], "--steps", "0"]
    try:
        p = _run(cmd, timeout)
        if p.returncode != 0:
            trace = "Traceback (most recent call last)" in p.stderr
            return f"{'traceback' if trace else 'refused'}: {_line(p)}"
        p = _run([sys.executable, "-c", LOAD, run, run2], timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    if p.returncode != 0:
        return f"load failed: {_line(p)}"
    got = json.loads(p.stdout)
    return "equal" if got["n_differ"] == 0 else f"differ: {got['differ']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--render", action="store_true",
                    help="write the tables from the rows measured so far (a partial survey)")
    a = ap.parse_args()
    import transformers

    survey = json.loads((RESULTS / "hf_survey.json").read_text())["rows"]
    names = a.types or [r["type"] for r in survey if r["outcome"] == "equal"]
    done = {}
    if PARTIAL.is_file():
        done = {r["type"]: r for r in map(json.loads, PARTIAL.read_text().splitlines())}
    commit = _commit()
    with tempfile.TemporaryDirectory(prefix="rt-data-") as tmp:
        data = f"{tmp}/data"
        json_dir = Path(sysconfig.get_paths()["stdlib"]) / "json"
        subprocess.run([sys.executable, "-m", "meshplan", "-q", "prepare-data", "--input",
                        *map(str, sorted(json_dir.glob("*.py"))), "--out", data], check=True)

        def one(name: str) -> dict:
            if name in done or a.render:
                return done.get(name, {"type": name, "outcome": "not measured yet", "commit": ""})
            r = try_type(name, data, a.timeout) | {"commit": commit}
            with PARTIAL.open("a") as f:
                f.write(json.dumps(r) + "\n")
            print(f"{r['type']:<28} {r['outcome']:<16} {r.get('init_from', '')[:60]:<60} "
                  f"{r.get('line', '')[:100]}", flush=True)
            return r

        with ThreadPoolExecutor(a.jobs) as pool:
            rows = list(pool.map(one, names))
    outcomes: dict[str, int] = {}
    for r in rows:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    starts: dict[str, int] = {}
    for r in rows:
        kind = r.get("init_from", "not tried").split(":")[0]
        starts[kind] = starts.get(kind, 0) + 1
    data_out = {"transformers": transformers.__version__, "rows": rows}
    (RESULTS / "hf_round_trip.json").write_text(json.dumps(data_out, indent=1) + "\n")
    lines = [f"# transformers {transformers.__version__}: trained, exported, loaded back", "",
             "Each type the survey judged equal: `meshplan train --hf TYPE --size tiny` on "
             "byte data, 1 rank, 2 steps, a checkpoint, `--export-hf A`; `meshplan export RUN "
             "--format hf --out B`; A and B loaded by `from_pretrained` of their recorded class "
             "in a fresh process, no key missing or unexpected, every tensor equal to the "
             "run's weights; then `train --init-from B --steps 0`, its weights the run's "
             "(`benchmarks/hf_round_trip.py`).", "",
             ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items())), "",
             "--init-from the export: " + ", ".join(
                 f"{v} {k}" for k, v in sorted(starts.items())), "",
             "| type | outcome | class | tensors | s | --init-from B | line | commit |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| `{r['type']}` | {r['outcome']} | {r.get('class', '')} | "
              f"{r.get('tensors', '')} | {r.get('s', '')} | "
              f"{r.get('init_from', '').replace('|', '/')[:120]} | "
              f"{r.get('line', '').replace('|', '/')[:200]} | {r['commit']} |" for r in rows]
    (RESULTS / "hf_round_trip.md").write_text("\n".join(lines) + "\n")
    if not a.render:
        PARTIAL.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
