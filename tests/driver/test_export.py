"""`meshplan export` and `train --export-hf`, on tiny transformers runs
(gpt2, tied embeddings; llama) trained at tp2 pp2: the export loads with
transformers' own `from_pretrained`, holds the run's trained weights bit
for bit, computes the trained module's logits bit for bit, writes a tied
tensor once, shards, carries the tokenizer; the torch format loads into the
module; a checkpoint is read one tensor at a time; a failure leaves nothing."""

from __future__ import annotations

import json
import sysconfig
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from meshplan.cli.main import main

transformers = pytest.importorskip("transformers")

JSON_DIR = Path(sysconfig.get_paths()["stdlib"]) / "json"
TRAIN = ["--size", "tiny", "--devices-per-node", "4", "--tp", "2", "--pp", "2", "--vpp", "1",
         "--global-batch-size", "8", "--micro-batch-size", "2", "--steps", "4",
         "--warmup-steps", "1", "--checkpoint-every", "2", "--eval-every", "0",
         "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "bpe"
    assert main(["-q", "prepare-data", "--input", str(JSON_DIR / "*.py"), "--out", str(out),
                 "--tokenizer", "bpe:512"]) == 0
    return out


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def run(request, data, tmp_path_factory):
    """(model type, run dir, data dir): 4 steps, checkpoints at 2 and 4,
    the trained model also exported from memory (--export-hf)."""
    tmp = tmp_path_factory.mktemp(request.param)
    out = tmp / "run"
    assert main(["-q", "train", "--data", str(data), "--out", str(out), *TRAIN,
                 "--hf", request.param, "--export-hf", str(tmp / "from-train")]) == 0
    return request.param, out, data


def _export(src, out, *flags) -> None:
    assert main(["-q", "export", str(src), "--out", str(out), *flags]) == 0


def _trained(run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's own consolidated weights, every alias of a tied tensor too."""
    weights = load_file(run_dir / "model.safetensors")
    with safe_open(run_dir / "model.safetensors", "pt") as f:
        aliases = json.loads(f.metadata()["aliases"])
    return weights | {alias: weights[name] for alias, name in aliases.items()}


def _meshplan_module(model_type: str, data: Path, weights: dict):
    """The module meshplan trained (built as the run built it), with `weights`
    loaded (every name it holds; rotary tables, non-persistent, ignored)."""
    from meshplan.driver.train_model import sized_config
    from meshplan.models.hf import build_hf

    module = build_hf(sized_config(f"hf:{model_type}", "tiny", str(data), {}))
    missing, unexpected = module.load_state_dict(weights, strict=False)
    assert not missing and all(k.endswith("inv_freq") for k in unexpected), unexpected
    return module.eval()


@pytest.mark.slow
def test_hf_export_is_the_trained_model(run, tmp_path):
    model_type, run_dir, data = run
    _export(run_dir, tmp_path / "hf", "--format", "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = _trained(run_dir)
    state = model.state_dict()
    assert set(state) == {k.removeprefix("model.") for k in trained
                          if not k.endswith("inv_freq")}  # rotary tables: not state
    for name, t in state.items():
        assert t.dtype == trained["model." + name].dtype
        assert torch.equal(t, trained["model." + name]), name
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _meshplan_module(model_type, data, trained).model(input_ids=ids).logits
        got = model(input_ids=ids).logits
    assert torch.equal(got, want)


@pytest.mark.slow
def test_tied_weights_are_written_once(run, tmp_path):
    model_type, run_dir, _ = run
    _export(run_dir / "checkpoints" / "step_4", tmp_path / "hf", "--format", "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    if model_type == "gpt2":  # lm_head tied to the embedding: only the embedding is stored
        assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    else:  # llama's are not tied: both stored
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= names
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == (model_type == "gpt2")


@pytest.mark.slow
def test_shards_load(run, tmp_path):
    _, run_dir, _ = run
    _export(run_dir, tmp_path / "hf", "--format", "hf", "--max-shard-size", "200KB")
    files = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(files) >= 3
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = _trained(run_dir)
    assert all(torch.equal(t, trained["model." + n]) for n, t in model.state_dict().items())


@pytest.mark.slow
def test_tokenizer_loads(run, tmp_path):
    from meshplan.data.tokenizer import load_tokenizer

    _, run_dir, data = run
    _export(run_dir, tmp_path / "hf", "--format", "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = load_tokenizer(data)
    text = "def loads(s, *, cls=None):\n    return json.decoder(s)\n"
    assert tok(text, add_special_tokens=False).input_ids == ours.encode(text)
    assert tok.eos_token_id == ours.eod and tok.bos_token_id == ours.eod
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")  # generate stops there
    assert config.eos_token_id == ours.eod and config.bos_token_id == ours.eod


@pytest.mark.slow
def test_torch_export_loads_into_the_module(run, tmp_path):
    model_type, run_dir, data = run
    _export(run_dir, tmp_path / "pt", "--format", "torch")
    state = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    trained = _trained(run_dir)
    assert all(torch.equal(state[n], trained[n]) for n in state)
    if model_type == "gpt2":
        assert state["model.lm_head.weight"] is state["model.transformer.wte.weight"]
    module = _meshplan_module(model_type, data, state)
    module.load_state_dict(state, strict=True)  # every name the module has, no other
    for name, t in module.state_dict().items():
        assert torch.equal(t, trained[name]), name


@pytest.mark.slow
def test_torch_shards(run, tmp_path):
    _, run_dir, _ = run
    _export(run_dir, tmp_path / "pt", "--format", "torch", "--max-shard-size", "100KB")
    index = json.loads((tmp_path / "pt" / "model.pt.index.json").read_text())
    state = {}
    for f in sorted(set(index["weight_map"].values())):
        state |= torch.load(tmp_path / "pt" / f, weights_only=True)
    trained = _trained(run_dir)
    assert set(state) == set(index["weight_map"])
    assert all(n.endswith("inv_freq") for n in set(trained) - set(state))
    assert all(torch.equal(state[n], trained[n]) for n in state)


@pytest.mark.slow
def test_train_export_hf_equals_export_of_the_last_checkpoint(run, tmp_path):
    _, run_dir, _ = run
    _export(run_dir, tmp_path / "hf", "--format", "hf")
    from_train = run_dir.parent / "from-train"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (from_train / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name


@pytest.mark.slow
@pytest.mark.parametrize("fmt,size", [("hf", "5GB"), ("torch", "1")])
def test_a_checkpoint_is_read_one_tensor_at_a_time(run, tmp_path, monkeypatch, fmt, size):
    """Each tensor read is dropped before the next is read: the reader is
    wrapped to hold a weak reference to every tensor it returns (a torch
    shard holds its own tensors, so torch is checked at a tensor a shard)."""
    import meshplan.driver.export as export_mod
    from meshplan.driver.export import ExportFormat, checkpoint_source, export

    _, run_dir, _ = run
    read, returned, live_at_read = export_mod.read_tensor, [], []

    def counting(*args, **kwargs):  # tensors hold no cycles: refcounts free them at once
        live_at_read.append(sum(r() is not None for r in returned))
        t = read(*args, **kwargs)
        returned.append(weakref.ref(t))
        return t

    monkeypatch.setattr(export_mod, "read_tensor", counting)  # the name export reads by
    source = checkpoint_source(str(run_dir))
    r = export(source, ExportFormat(fmt), str(tmp_path / "out"), size)
    assert len(returned) == r.tensors == len(live_at_read) > 10
    assert max(live_at_read) == 0


@pytest.mark.slow
def test_a_failure_leaves_nothing(run, tmp_path, monkeypatch):
    import meshplan.driver.export as export_mod
    from meshplan.driver.export import ExportFormat, checkpoint_source, export

    _, run_dir, _ = run
    read, calls = export_mod.read_tensor, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return read(*args, **kwargs)

    monkeypatch.setattr(export_mod, "read_tensor", failing)
    out = tmp_path / "deep" / "out"
    with pytest.raises(OSError):
        export(checkpoint_source(str(run_dir)), ExportFormat.HF, str(out), "100KB")
    assert list(tmp_path.iterdir()) == []
