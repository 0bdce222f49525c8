"""The CLI: verbs work, and user mistakes are one line with exit code 2."""

import json
import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshplan", *args],
                          capture_output=True, text=True, timeout=300)


def assert_user_error(p: subprocess.CompletedProcess, phrase: str) -> None:
    assert p.returncode == 2, p
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("meshplan: error: ")
    assert phrase in lines[0]


def test_verify_json_reports_equal_losses():
    p = run("verify", "--model", "gpt", "--size", "tiny", "--steps", "3", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert len(r["losses"]) == len(r["ref_losses"]) == 3
    assert r["ok"] and r["max_abs_diff"] <= 1e-5
    # every parameter of the model, by FQN, with its figures
    assert {"wte.weight", "ln_f.bias"} <= set(r["params"])
    assert all({"max_abs", "max_rel"} <= set(d) for d in r["params"].values())


def test_verify_runs_the_plan_a_flag_asks_for():
    """--vpp 2 on one rank is two virtual stages: verify trains that plan, not
    one process of the whole model (it once did, and said OK for a layout it
    never ran)."""
    p = run("verify", "--model", "gpt", "--steps", "1", "--vpp", "2", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["mode"] == "distributed"
    plain = json.loads(run("verify", "--model", "gpt", "--steps", "1", "--json").stdout)
    assert plain["mode"] == "single"


def test_verify_table():
    p = run("verify", "--model", "resnet", "--steps", "2")
    assert p.returncode == 0, p.stderr
    assert "OK: losses of 1 loss-holding rank(s)" in p.stdout
    assert "parameter tensors, worst max_rel" in p.stdout


def test_verify_fails_with_exit_1_when_a_tolerance_cannot_be_met():
    """A negative bound no run can meet: the verdict is MISMATCH and exit 1,
    naming the tensors (the check can fail through the CLI)."""
    p = run("verify", "--model", "gpt", "--steps", "1", "--tolerance", "-1")
    assert p.returncode == 1, p.stderr
    assert "MISMATCH" in p.stdout and "FAIL" not in p.stderr


def test_inspect_json_counts():
    p = run("inspect", "--model", "bert", "--size", "tiny", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["layers"] == 4 and r["params"] > 0 and r["generic_ops"] == []


@pytest.mark.parametrize(
    "args, phrase",
    [
        (("verify", "--model", "gtp"), "unknown model 'gtp'"),
        (("verify", "--model", "gpt", "--size", "huge"), "unknown size 'huge'"),
        (("verify", "--heads", "5"), "heads=5 does not divide hidden=64"),
        (("verify", "--hidden", "-4"), "hidden"),
        (("inspect", "--model", "resnet", "--vocab", "10"), "vocab"),
        (("verify", "--global-batch-size", "8", "--num-microbatches", "3"), "contradicts"),
        (("verify", "--devices-per-node", "2", "--pp", "2", "--num-microbatches", "1"),
         "num_microbatches >= pp"),
    ],
)
def test_user_mistakes_are_one_line(args, phrase):
    assert_user_error(run(*args), phrase)


def test_debug_shows_the_traceback():
    p = run("--debug", "verify", "--model", "gtp")
    assert p.returncode != 0 and "Traceback" in p.stderr


def verbs() -> dict:
    from meshplan.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "verb")
    return dict(sub.choices)


def test_every_verb_has_help_with_examples_and_json():
    found = verbs()
    assert {"inspect", "verify", "plan", "compile", "check", "show", "run", "demo"} <= set(found)
    for name, parser in found.items():
        text = parser.format_help()
        assert "examples:" in text and f"meshplan {name}" in text.split("examples:")[1], name
        assert "--json" in text, name
    p = run("demo", "--help")  # and through the real command
    assert p.returncode == 0 and "examples:" in p.stdout
