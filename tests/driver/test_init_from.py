"""`train --init-from`: a transformers save_pretrained directory (gpt2,
llama), a torch state dict or a meshplan checkpoint starts a run at tp2·pp2;
each rank reads only its own slices; a tensor missing, of another shape, or
of another model is one line, exit 2, and nothing is written."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from meshplan.cli.main import main

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

JSON_DIR = Path(sysconfig.get_paths()["stdlib"]) / "json"
TP2_PP2 = ["--devices-per-node", "4", "--tp", "2", "--pp", "2", "--vpp", "1",
           "--global-batch-size", "8", "--micro-batch-size", "2", "--sample-tokens", "0"]


def _saved(kind: str, root: Path) -> Path:
    """A tiny random `kind` model written by transformers' save_pretrained."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(1)
    cfg = (transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2,
                                   n_head=4) if kind == "gpt2" else
           transformers.LlamaConfig(vocab_size=512, max_position_embeddings=64, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))
    out = root / kind
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """BPE data of 512 tokens (tp2 splits the vocabulary) and the two models."""
    tmp = tmp_path_factory.mktemp("init")
    assert main(["-q", "prepare-data", "--input", str(JSON_DIR / "*.py"), "--out",
                 str(tmp / "data"), "--tokenizer", "bpe:512"]) == 0
    return tmp, {k: _saved(k, tmp) for k in ("gpt2", "llama")}


def _model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_round_trip_through_transformers_at_the_start(saved, kind, tmp_path):
    """Started from a save_pretrained directory at tp2·pp2 (the model is the
    one its config.json describes: no --hf, no sizes) and exported after 0
    steps: the run's weights are the saved ones, and the export's logits are
    the original's, bit for bit."""
    tmp, models = saved
    out, export = tmp_path / "run", tmp_path / "export"
    assert main(["-q", "train", "--data", str(tmp / "data"), "--out", str(out),
                 "--init-from", str(models[kind]), *TP2_PP2, "--steps", "0",
                 "--eval-every", "1", "--eval-batches", "1", "--export-hf", str(export)]) == 0
    given = safetensors_torch.load_file(models[kind] / "model.safetensors")
    got = safetensors_torch.load_file(out / "model.safetensors")
    assert all(torch.equal(t, got["model." + k]) for k, t in given.items())
    assert json.loads((out / "model.json").read_text())["hf_config"]["model_type"] == kind
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(_model(export)(ids).logits, _model(models[kind])(ids).logits)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_round_trip_after_training(saved, kind, tmp_path):
    """After 5 steps at tp2·pp2, transformers' loss of the export on the
    validation batch is meshplan's evaluation at step 5 within 1e-5."""
    from meshplan.data.feed import FeedReader, TokenFeed
    from meshplan.driver.metrics import read_metrics

    tmp, models = saved
    out, export = tmp_path / "run", tmp_path / "export"
    assert main(["-q", "train", "--data", str(tmp / "data"), "--out", str(out),
                 "--init-from", str(models[kind]), *TP2_PP2, "--steps", "5",
                 "--warmup-steps", "1", "--eval-every", "5", "--eval-batches", "1",
                 "--export-hf", str(export)]) == 0
    ours = [r["eval_loss"] for r in read_metrics(out) if r["kind"] == "eval"
            and r["step"] == 5]
    seq_len = json.loads((out / "run.json").read_text())["seq_len"]  # 64: the model's
    feed = TokenFeed(str(tmp / "data"), "validation", seq_len, 0, "shifted-by-model",
                     shuffle=False)
    model = _model(export)
    with torch.no_grad():
        losses = [model(input_ids=x, labels=y).loss
                  for x, y in FeedReader(feed, 8, 4).microbatches(0)]
    theirs = float(torch.stack(losses).mean())
    assert ours and abs(ours[0] - theirs) <= 1e-5, (ours, theirs)
    assert not torch.equal(model.lm_head.weight, _model(models[kind]).lm_head.weight)


def test_each_rank_reads_only_its_slices(saved, monkeypatch):
    """A tp2 rank asks safetensors for exactly its box of each tensor, never
    the whole of a split one."""
    from meshplan.driver.init_from import weight_source
    from meshplan.driver.plan import plan_model, zoo_strategy
    from meshplan.ir.mesh import Mesh
    from meshplan.lowering.lower import lower
    from meshplan.models import model_config
    from meshplan.runtime import init_weights
    from meshplan.runtime.bind import RankContext

    tmp, models = saved
    cfg = model_config("hf:", "tiny", source=str(models["gpt2"]))
    job = plan_model(cfg.model, "tiny", Mesh(1, 2), zoo_strategy(cfg.model, cfg, tp=2,
                     global_batch_size=2, micro_batch_size=2), source=cfg.source).job
    source = weight_source(str(models["gpt2"]), job, "model.")
    ctx = RankContext(job, lower(job, 1))
    ids = {job.graph.values[i].name: i for i in job.graph.inputs}
    state = {n: torch.zeros([b - a for a, b in ctx.box(ids[n])])
             for n in json.loads(source)["tensors"]}
    asked = []

    class Recording:
        def __init__(self, f):
            self.f = f

        def get_slice(self, key):
            outer = self.f.get_slice(key)

            class Slice:
                def __getitem__(self, index):
                    asked.append((key, index))
                    return outer[index]
            return Slice()

        def get_tensor(self, key):
            asked.append((key, "whole"))
            return self.f.get_tensor(key)

    real = init_weights.read_box

    def recording_read(files, file, key, box):
        if file not in files:
            from safetensors import safe_open
            files[file] = Recording(safe_open(file, framework="pt"))
        return real(files, file, key, box)

    monkeypatch.setattr(init_weights, "read_box", recording_read)
    init_weights.load_weights(source, state, ctx)
    full = safetensors_torch.load_file(models["gpt2"] / "model.safetensors")
    split = 0
    for key, index in asked:
        name = next(n for n in state if n.removeprefix("model.") == key)
        assert index == tuple(slice(a, b) for a, b in ctx.box(ids[name])), key
        split += any(s.stop - s.start < d for s, d in zip(index, full[key].shape))
    assert split > 0  # tp2 splits some tensors: those reads are half of them
    for name, t in state.items():
        assert torch.equal(t, full[name.removeprefix("model.")][
            tuple(slice(a, b) for a, b in ctx.box(ids[name]))])


@pytest.mark.slow
def test_a_state_dict_and_a_checkpoint_start_the_run(saved, tmp_path):
    """A torch state dict of the module, and a meshplan checkpoint (weights
    only: the run starts at step 0 with fresh optimizer slots), at another
    layout than the one that saved it."""
    tmp, _ = saved
    zoo = ["--size", "tiny", "--global-batch-size", "8", "--micro-batch-size", "2",
           "--sample-tokens", "0", "--eval-every", "0", "--lr-schedule", "constant"]
    first = tmp_path / "first"
    assert main(["-q", "train", "--data", str(tmp / "data"), "--out", str(first), *zoo,
                 "--devices-per-node", "2", "--tp", "2", "--pp", "1", "--vpp", "1",
                 "--steps", "2", "--checkpoint-every", "2"]) == 0
    trained = safetensors_torch.load_file(first / "model.safetensors")
    torch.save(trained, tmp_path / "sd.pt")
    for source in (tmp_path / "sd.pt", first / "checkpoints" / "step_2"):
        out = tmp_path / f"from_{source.stem}"
        assert main(["-q", "train", "--data", str(tmp / "data"), "--out", str(out), *zoo,
                     "--devices-per-node", "2", "--tp", "1", "--pp", "2", "--vpp", "1",
                     "--steps", "0", "--init-from", str(source)]) == 0
        got = safetensors_torch.load_file(out / "model.safetensors")
        assert got.keys() == trained.keys()
        assert all(torch.equal(got[k], trained[k]) for k in trained)


@pytest.mark.slow
def test_a_text_model_of_a_multimodal_type_starts_as_its_class(saved, tmp_path):
    """A save_pretrained `MllamaForCausalLM` (as `export --format hf` of
    `--hf mllama` writes it) holds `MllamaTextConfig`, which no Auto class
    maps: the run is that class (its config's `architectures`), a causal LM,
    its weights the saved ones."""
    tmp, _ = saved
    transformers.logging.set_verbosity_error()
    torch.manual_seed(2)
    cfg = transformers.MllamaTextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1],
        max_position_embeddings=64, pad_token_id=0)
    transformers.MllamaForCausalLM(cfg).save_pretrained(tmp_path / "mllama")
    out = tmp_path / "run"
    assert main(["-q", "train", "--data", str(tmp / "data"), "--out", str(out), "--init-from",
                 str(tmp_path / "mllama"), "--devices-per-node", "1", "--tp", "1", "--pp", "1",
                 "--vpp", "1", "--global-batch-size", "2", "--micro-batch-size", "2",
                 "--sample-tokens", "0", "--steps", "0", "--eval-every", "0"]) == 0
    given = safetensors_torch.load_file(tmp_path / "mllama" / "model.safetensors")
    got = safetensors_torch.load_file(out / "model.safetensors")
    assert all(torch.equal(t, got["model." + k]) for k, t in given.items())
    # (taken for a masked LM, it was refused: the BPE data has no mask token)
    assert json.loads((out / "model.json").read_text())["architecture"] == "MllamaForCausalLM"


@pytest.mark.slow
def test_bad_weights_are_one_line_and_write_nothing(saved, tmp_path, capsys):
    """A tensor missing, a shape of another size, another model's checkpoint,
    a corrupted file: exit 2, one line naming it, no run directory."""
    tmp, models = saved
    sd = safetensors_torch.load_file(models["gpt2"] / "model.safetensors")
    missing = dict(sd)
    del missing["transformer.h.1.mlp.c_fc.weight"]
    safetensors_torch.save_file(missing, tmp_path / "missing.safetensors")
    wrong = dict(sd)
    wrong["transformer.h.0.attn.c_proj.weight"] = torch.zeros(64, 32)
    safetensors_torch.save_file(wrong, tmp_path / "wrong.safetensors")
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{no")
    hf = ["--hf", "gpt2", "--size", "tiny", "--layers", "2", "--seq-len", "64",
          "--devices-per-node", "1", "--tp", "1", "--pp", "1", "--vpp", "1", "--steps", "0"]
    cases = {"missing.safetensors": "'transformer.h.1.mlp.c_fc.weight'",
             "wrong.safetensors": "'transformer.h.0.attn.c_proj.weight' is [64, 32]",
             "corrupt.safetensors": "cannot read it"}
    for i, (name, said) in enumerate(cases.items()):
        out = tmp_path / f"out{i}"
        assert main(["train", "--data", str(tmp / "data"), "--out", str(out), *hf,
                     "--init-from", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
        assert not out.exists()
    out = tmp_path / "other"
    assert main(["train", "--data", str(tmp / "data"), "--out", str(out), "--size", "tiny",
                 "--devices-per-node", "1", "--tp", "1", "--pp", "1", "--vpp", "1",
                 "--steps", "0", "--init-from", str(models["llama"]), "--hf", "gpt2"]) == 2
    assert "holds a llama model, not gpt2" in capsys.readouterr().err
    assert not out.exists()
