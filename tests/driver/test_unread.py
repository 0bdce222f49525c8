"""Weights no op of the step reads (ESM's contact head, when it trains as a
masked LM): a run ends them as it started them, whether they started as the
module's, `--init-from`'s or a resumed checkpoint's; every checkpoint holds
them, so `export --format hf` of it loads in transformers; a damaged copy
is one line, exit 2, and nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshplan.cli.main import main
from meshplan.driver.unread import UNREAD_FILE
from meshplan.ir.fileio import read_sealed, seal, write_atomic
from meshplan.runtime.checkpoint import COMPLETE, KIND, VERSION
from tests.token_data import prepare, stdlib_sources

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HEAD = ("esm.contact_head.regression.weight", "esm.contact_head.regression.bias")
DP2 = ["--hf", "esm", "--size", "tiny", "--devices-per-node", "2", "--dp", "2", "--tp", "1",
       "--pp", "1", "--vpp", "1", "--eval-every", "0", "--warmup-steps", "0",
       "--lr-schedule", "constant", "--checkpoint-every", "2"]


def _train(data: str, out: Path, *flags: str) -> None:
    assert main(["-q", "train", "--data", data, "--out", str(out), *DP2, *flags]) == 0


def _head(export: Path) -> dict[str, torch.Tensor]:
    weights = safetensors_torch.load_file(export / "model.safetensors")
    return {k: weights[k] for k in HEAD}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in HEAD)


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """Byte data, a 2-step ESM run at dp2 from the module's weights (seed 0),
    and `export --format hf` of its checkpoint."""
    tmp = tmp_path_factory.mktemp("unread")
    data = prepare(tmp / "data", stdlib_sources(3))
    _train(data, tmp / "r1", "--steps", "2")
    assert main(["-q", "export", str(tmp / "r1"), "--format", "hf",
                 "--out", str(tmp / "e1")]) == 0
    return tmp, data


@pytest.mark.slow
def test_a_checkpoint_exports_the_weights_no_op_reads(first):
    """The exported head is the run's (its start: the module's), and
    transformers loads the export with no weight missing."""
    tmp, _ = first
    run = safetensors_torch.load_file(tmp / "r1" / "model.safetensors")
    assert _same(_head(tmp / "e1"), {k: run["model." + k] for k in HEAD})
    torch.manual_seed(0)
    model, info = transformers.AutoModelForMaskedLM.from_pretrained(
        tmp / "e1", output_loading_info=True)
    assert not info["missing_keys"], info
    assert (tmp / "r1" / "checkpoints" / "step_2" / UNREAD_FILE).is_file()


@pytest.mark.slow
@pytest.mark.parametrize("start", ["checkpoint", "state-dict"])
def test_init_from_keeps_the_given_weights_a_resume_too(first, start, tmp_path):
    """Started at another seed (other module weights) from the first run's
    checkpoint or weights file, the head ends as given, in the run's weights,
    `--export-hf`, its checkpoint's export, and after `--resume` with no
    `--init-from` (the checkpoint's copy)."""
    tmp, data = first
    given = _head(tmp / "e1")
    source = tmp / "r1" / ("checkpoints/step_2" if start == "checkpoint" else "model.safetensors")
    out = tmp_path / "r2"
    _train(data, out, "--steps", "2", "--seed", "5", "--init-from", str(source),
           "--export-hf", str(tmp_path / "e2"))
    assert _same(_head(tmp_path / "e2"), given)
    _train(data, out, "--steps", "4", "--seed", "5", "--resume", "--export-hf",
           str(tmp_path / "e3"))
    assert _same(_head(tmp_path / "e3"), given)
    assert main(["-q", "export", str(out), "--format", "hf", "--out",
                 str(tmp_path / "e4")]) == 0
    assert _same(_head(tmp_path / "e4"), given)
    trained = safetensors_torch.load_file(tmp_path / "e3" / "model.safetensors")
    assert not torch.equal(trained["lm_head.dense.weight"],
                           safetensors_torch.load_file(tmp / "e1" / "model.safetensors")
                           ["lm_head.dense.weight"])


@pytest.mark.slow
def test_a_damaged_or_missing_copy_is_one_line(first, tmp_path, capsys):
    """An edited `unread_weights.pt` fails its digest; a checkpoint whose
    marker names none (saved by an earlier meshplan) cannot export its
    model whole: both one line, exit 2, nothing written."""
    import shutil

    tmp, _ = first
    ckpt = tmp_path / "step_2"
    shutil.copytree(tmp / "r1" / "checkpoints" / "step_2", ckpt)
    values = torch.load(ckpt / UNREAD_FILE)
    torch.save({k: v + 1 for k, v in values.items()}, ckpt / UNREAD_FILE)
    assert main(["-q", "export", str(ckpt), "--format", "hf", "--out",
                 str(tmp_path / "bad")]) == 2
    assert "unread_weights.pt is missing or not the one saved" in capsys.readouterr().err
    meta = read_sealed(ckpt / COMPLETE, KIND, VERSION)
    del meta["files"][UNREAD_FILE]
    write_atomic(ckpt / COMPLETE, seal(KIND, VERSION, meta))
    assert main(["-q", "export", str(ckpt), "--format", "hf", "--out",
                 str(tmp_path / "old")]) == 2
    assert "contact_head" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "old").exists()


@pytest.mark.slow
def test_a_masked_lm_meshplan_trained_starts_a_run_from_its_export(first, tmp_path, capsys):
    """The export of a masked LM trained on byte data (its mask one id past
    the bytes, as meshplan embeds it) starts a run on that data: the mask
    is that id again, and the weights are the export's. A saved model whose
    vocabulary is not one past the data's is still refused (`test_train_pairs`)."""
    tmp, data = first
    out = tmp_path / "again"
    assert main(["-q", "train", "--data", data, "--out", str(out), "--init-from",
                 str(tmp / "e1"), "--devices-per-node", "1", "--dp", "1", "--tp", "1",
                 "--pp", "1", "--vpp", "1", "--steps", "0", "--eval-every", "0",
                 "--sample-tokens", "0"]) == 0
    given = safetensors_torch.load_file(tmp / "e1" / "model.safetensors")
    got = safetensors_torch.load_file(out / "model.safetensors")
    assert all(torch.equal(t, got["model." + k]) for k, t in given.items())
