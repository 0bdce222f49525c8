"""Periodic checkpoints in `meshplan train` and `--resume`: at the same
layout the steps after the checkpoint are bit for bit the uninterrupted
run's; at another layout (dp4 with ZeRO 3, tp2 pp2) within 1e-5, reading the
same samples (the data order is a function of the step, not the layout).
Dropout is on: its masks do not depend on the layout, nor, the model's
tensors being batch-major, on where micro-batches split the batch (dp4 runs
one micro-batch where dp2 pp2 ran two)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from meshplan.cli.main import main
from meshplan.data.feed import FeedReader, TokenFeed
from meshplan.driver.metrics import read_metrics
from meshplan.driver.train import samples_digest

JSON_DIR = Path(sysconfig.get_paths()["stdlib"]) / "json"
COMMON = ["--size", "tiny", "--global-batch-size", "8", "--micro-batch-size", "2",
          "--steps", "6", "--optimizer", "adamw", "--lr", "3e-3", "--lr-schedule", "cosine",
          "--warmup-steps", "2", "--min-lr", "0", "--clip-grad-norm", "1.0",
          "--eval-every", "0", "--sample-tokens", "0", "--tensorboard", "--dropout", "0.1"]
DP2_PP2 = ["--devices-per-node", "4", "--tp", "1", "--pp", "2", "--vpp", "1"]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")
            if r["kind"] == "train"}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """Prepared data and an uninterrupted 6-step run saving every 3 steps."""
    tmp = tmp_path_factory.mktemp("resume")
    data = tmp / "data"
    assert main(["-q", "prepare-data", "--input", str(JSON_DIR / "*.py"), "--out",
                 str(data)]) == 0
    out = tmp / "first"
    assert main(["-q", "train", "--data", str(data), "--out", str(out), *COMMON, *DP2_PP2,
                 "--checkpoint-every", "3", "--keep", "0"]) == 0
    return data, out


@pytest.mark.slow
def test_checkpoints_are_complete_and_pruned(first, tmp_path):
    data, out = first
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3", "step_6"]
    assert all((out / "checkpoints" / n / "COMPLETE").is_file() for n in ("step_3", "step_6"))
    kept = tmp_path / "kept"
    assert main(["-q", "train", "--data", str(data), "--out", str(kept), *COMMON, *DP2_PP2,
                 "--steps", "4", "--checkpoint-every", "1", "--keep", "2"]) == 0
    assert sorted(p.name for p in (kept / "checkpoints").iterdir()) == ["step_3", "step_4"]


@pytest.mark.slow
def test_resume_at_the_same_layout_is_bit_identical(first, tmp_path):
    data, out = first
    again = tmp_path / "again"
    assert main(["-q", "train", "--data", str(data), "--out", str(again), *COMMON, *DP2_PP2,
                 "--resume", str(out / "checkpoints" / "step_3")]) == 0
    whole, resumed = _losses(out), _losses(again)
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[k] == whole[k] for k in resumed), (resumed, whole)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--devices-per-node", "4", "--tp", "1", "--pp", "1", "--vpp", "1", "--zero", "3"],
    ["--devices-per-node", "4", "--tp", "2", "--pp", "2", "--vpp", "1"]],
    ids=["dp4-zero3", "tp2-pp2"])
def test_resume_at_another_layout_within_1e_5(first, tmp_path, layout):
    data, out = first
    other = tmp_path / "other"
    assert main(["-q", "train", "--data", str(data), "--out", str(other), *COMMON, *layout,
                 "--resume", str(out / "checkpoints" / "step_3")]) == 0
    whole, resumed = _losses(out), _losses(other)
    assert sorted(resumed) == [4, 5, 6]
    assert max(abs(resumed[k] - whole[k]) for k in resumed) < 1e-5, (resumed, whole)
    # the samples read, by their ids: the ones the uninterrupted run read, and
    # exactly those a global batch of the step holds (seed 0, seq_len 16)
    assert _samples(other) == {k: v for k, v in _samples(out).items() if k > 3}
    reader = FeedReader(TokenFeed(str(data), "train", 16, 0), 8, 4)
    for k, fingerprint in _samples(other).items():
        reader.microbatches(k - 1)
        assert fingerprint == samples_digest([reader.step_samples]), k


def _samples(out: Path) -> dict[int, str]:
    return {r["step"]: r["data_sha256"] for r in read_metrics(out / "metrics.jsonl")
            if r["kind"] == "train"}


@pytest.mark.slow
def test_a_corrupted_shard_is_one_line_and_nothing_is_overwritten(first, tmp_path, capsys):
    """A flipped byte in a tensor's bytes of one rank's shard: resuming from
    it, starting from it (--init-from) and exporting it are one line each,
    exit 2; the run that would resume writes no weights."""
    import shutil

    import torch.distributed.checkpoint as dcp

    data, out = first
    bad = tmp_path / "step_3"
    shutil.copytree(out / "checkpoints" / "step_3", bad)
    md = dcp.FileSystemReader(str(bad)).read_metadata()
    key = max((k for k in md.state_dict_metadata if k.startswith("wte.weight|")),
              key=lambda k: k)
    info = next(v for i, v in md.storage_data.items() if i.fqn == key)
    shard = bad / info.relative_path
    good = shard.read_bytes()
    for flipped, said in ((info.offset + info.length // 2, "'wte.weight|"),  # a weight's bytes
                          (info.offset + info.length - 64, "cannot be read")):  # its zip index
        raw = bytearray(good)
        raw[flipped] ^= 0x40
        shard.write_bytes(bytes(raw))
        for i, args in enumerate((["--resume", str(bad)], ["--init-from", str(bad)])):
            where = tmp_path / f"{flipped}_{i}"
            assert main(["train", "--data", str(data), "--out", str(where), *COMMON, *DP2_PP2,
                         *args]) == 2
            err = capsys.readouterr().err.strip()
            assert said in err and "corrupted" in err and len(err.splitlines()) == 1, err
            assert not (where / "model.safetensors").exists()
        assert main(["export", str(bad), "--format", "torch", "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert "corrupted" in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "x").exists()


def test_resume_of_a_run_directory_takes_its_newest_checkpoint(first, tmp_path, capsys):
    data, out = first
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "r"), *COMMON, *DP2_PP2,
                 "--resume", str(out)]) == 2
    assert "step_6: it is already 6 steps into the run" in capsys.readouterr().err


def test_resume_refuses_another_global_batch(first, tmp_path, capsys):
    data, out = first
    bad = tmp_path / "bad"
    assert main(["train", "--data", str(data), "--out", str(bad), *COMMON, *DP2_PP2,
                 "--global-batch-size", "16", "--resume", str(out / "checkpoints" / "step_3")]
                ) == 2
    err = capsys.readouterr().err
    assert "global_batch_size 8" in err and "--global-batch-size 8" in err
    assert not bad.exists()
