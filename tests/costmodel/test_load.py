"""costmodel/load.py: the built-in files, cpu-local, and the errors."""

import json
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.costmodel import known_device_models, load_device_model
from meshplan.costmodel.load import device_model_json, parse_device_model
from meshplan.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEVICES = ROOT / "meshplan" / "costmodel" / "devices"
GPUS = ("a100-80gb", "h100-80gb", "h200-141gb")


@pytest.mark.parametrize("name", GPUS)
def test_each_built_in_model_loads_with_its_sources(name):
    dev = load_device_model(name)
    data = json.loads((DEVICES / f"{name}.json").read_text())
    assert dev.name == name == data["name"]
    assert dev.devices_per_node == 8
    assert {d for d, _ in dev.flops} == {"float32", "bfloat16", "float16"}
    for dtype, rate in dev.flops:
        entry = data["flops"][dtype]
        assert rate == pytest.approx(entry["peak"] * entry["efficiency"])
        assert dev.peak_flops_for(dtype) == entry["peak"] > rate
    assert dev.flops_for("bfloat16") > 10 * dev.flops_for("float32")
    assert dev.intra_bw > dev.inter_bw and dev.intra_latency <= dev.inter_latency
    assert dev.memory_bytes >= 80 * 2**30
    assert len(dev.sources) >= 4
    assert all("http" in s or "from memory" in s for s in dev.sources)


def test_datasheet_figures_as_the_sources_give_them():
    a100, h100, h200 = (load_device_model(n) for n in GPUS)
    assert a100.peak_flops_for("bfloat16") == 312e12
    assert h100.peak_flops_for("bfloat16") == h200.peak_flops_for("bfloat16") == 989.4e12
    assert h200.mem_bw / h100.mem_bw == pytest.approx(4.8 / 3.35)
    assert h200.memory_bytes > h100.memory_bytes == a100.memory_bytes


def test_the_known_names():
    names = known_device_models()
    assert set(GPUS) <= set(names) and "cpu-local" in names


def test_an_unknown_name_is_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError) as e:
        load_device_model("a100")
    msg = str(e.value)
    assert "\n" not in msg and "unknown device model 'a100'" in msg
    assert "a100-80gb" in msg and "meshplan calibrate" in msg


def test_cpu_local_before_calibrate_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="run `meshplan calibrate`"):
        load_device_model("cpu-local")


def test_cpu_local_is_read_from_meshplan_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_HOME", str(tmp_path))
    dev = load_device_model("a100-80gb")
    (tmp_path / "devices").mkdir()
    text = device_model_json(dev).replace('"a100-80gb"', '"cpu-local"')
    (tmp_path / "devices" / "cpu-local.json").write_text(text)
    local = load_device_model("cpu-local")
    assert local.name == "cpu-local" and local.flops == dev.flops and local.mem_bw == dev.mem_bw
    assert local.host_cores == 0  # a device of its own per rank unless the file says
    shared = replace(dev, name="cpu-local", host_cores=2)
    (tmp_path / "devices" / "cpu-local.json").write_text(device_model_json(shared))
    assert load_device_model("cpu-local") == shared


@pytest.mark.parametrize("text, phrase", [
    ("{", "is not JSON"),
    ("[]", "holds no JSON object"),
    ('{"name": "x"}', "lacks flops"),
])
def test_a_malformed_file_is_one_line(text, phrase):
    with pytest.raises(ConfigError, match=phrase) as e:
        parse_device_model(text, "x.json")
    assert "\n" not in str(e.value)


def test_a_bad_rate_is_one_line():
    data = json.loads((DEVICES / "a100-80gb.json").read_text())
    data["mem_bw"] = {"peak": 2e12, "efficiency": 1.5}
    with pytest.raises(ConfigError, match="above 1"):
        parse_device_model(json.dumps(data), "x.json")
    data["mem_bw"] = -1
    with pytest.raises(ConfigError, match="positive"):
        parse_device_model(json.dumps(data), "x.json")


def test_the_files_are_package_data():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "devices/*.json" in cfg["tool"]["setuptools"]["package-data"]["meshplan.costmodel"]


def test_the_cli_shows_a_model_and_refuses_an_unknown_one():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "meshplan", *args], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
    ok = run("devices", "h200-141gb", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["name"] == "h200-141gb"
    shown = run("devices", "a100-80gb")
    assert shown.returncode == 0 and "per kernel 5.0 us" in shown.stdout
    assert "host_cores" not in shown.stdout  # a GPU is its rank's own
    bad = run("devices", "b200")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("meshplan: error: unknown device model")
