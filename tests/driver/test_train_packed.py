"""`meshplan train --pack`: whole pairs packed into each row of a causal LM
(the zoo's GPT, a transformers one), each pair attending to its own tokens
(position ids that restart at it); against an eager PyTorch loop reading the same feed
(`tests/train_compare.py`), every loss, evaluation and parameter within
1e-5 (SGD, as the other pair tests: `test_train_pairs.py`). A model whose
attention ignores the restarts, and every other misuse, is one line."""

from __future__ import annotations

import pytest
import torch

from meshplan.cli.main import main
from meshplan.data.feed import Layout
from meshplan.driver.train_model import _check_packing, layout_of, sized_config
from meshplan.errors import ConfigError
from meshplan.models import build_model, model_config
from tests.token_data import pairs_jsonl, prepare, stdlib_sources
from tests.train_compare import train_and_compare

transformers = pytest.importorskip("transformers")
SEQ = 64  # two or three of the test's pairs a row, some cut


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Short pairs (a line's first 12 characters, and in upper case), every
    tenth whole (longer than a row: cut)."""
    import json

    d = tmp_path_factory.mktemp("packed")
    rows = pairs_jsonl(d / "full.jsonl", 240)
    short = [r if i % 10 == 0 else {"text": r["text"][:12], "target": r["target"][:12]}
             for i, r in enumerate(rows)]
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in short))
    return prepare(d / "data", [str(d / "pairs.jsonl")], "--target-field", "target",
                   "--val-fraction", "0.4")


@pytest.mark.slow
@pytest.mark.parametrize("model, flags, dp", [
    (["--hf", "llama"], ["--dp", "2", "--tp", "1", "--pp", "1"], 2),
    (["--hf", "gpt2"], ["--dp", "1", "--tp", "1", "--pp", "2"], 1),
    (["--model", "gpt"], ["--dp", "1", "--tp", "2", "--pp", "1"], 1),
    (["--model", "moe"], ["--dp", "2", "--ep", "2", "--tp", "1", "--pp", "1"], 2),
])
def test_a_packed_causal_lm_learns_as_eager(data, tmp_path, capsys, model, flags, dp):
    layout = Layout.PACKED if model[0] == "--model" else Layout.PACKED_SHIFTED
    s = train_and_compare(data, tmp_path / "run", [*model, "--pack", "--devices-per-node", "2",
                                                   *flags],
                          layout, dp, capsys, optimizer=("sgd", 0.3),
                          sizes={"seq_len": SEQ, "packed": True})
    assert s["packed"]["pairs_per_row"] > 1.5 and 0 < s["packed"]["filled"] <= 1
    assert set(s["answer"]) == {"source", "answer", "target"}


@pytest.mark.parametrize("model", ["hf:llama", "hf:gpt2", "gpt", "moe"])
def test_a_pair_packed_after_another_computes_as_alone(data, model, monkeypatch):
    """The loss of a row of two packed pairs is the mean of each pair's own
    loss, as if each had its row (the labels weigh them by target tokens).
    The MoE's load-balancing term is its row's, a regularizer: left out
    here, its cross-entropy is the pairs'."""
    monkeypatch.setattr("meshplan.models.moe.AUX_COEF", 0.0)
    torch.manual_seed(0)
    module = build_model(sized_config(model, "tiny", data, {"seq_len": SEQ,
                                                            "packed": True})).eval()
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, 256, (1, n), generator=gen) for n in (20, 30))
    la, lb = a.clone(), b.clone()
    la[:, :8] = lb[:, :12] = -100  # the sources
    if model in ("gpt", "moe"):  # the zoo labels the next tokens: a pair's last position none
        la, lb = (torch.cat([t[:, 1:], torch.full((1, 1), -100)], 1) for t in (la, lb))
    row = torch.cat([a, b], 1)
    labels = torch.cat([la, lb], 1)
    pos = torch.cat([torch.arange(20), torch.arange(30)])[None]
    with torch.no_grad():
        both = module(row, labels, pos)
        alone = [module(x, y, torch.arange(x.shape[1])[None]) for x, y in ((a, la), (b, lb))]
        across = module(row, labels, torch.arange(50)[None])  # one document: b sees a
    n = [int((t >= 0).sum()) for t in (la, lb)] if model in ("gpt", "moe") else \
        [int((t[:, 1:] >= 0).sum()) for t in (la, lb)]
    assert torch.allclose(both, (alone[0] * n[0] + alone[1] * n[1]) / sum(n), atol=1e-5)
    assert not torch.allclose(both, across, atol=1e-4)


def test_a_model_whose_attention_ignores_the_restarts_is_refused():
    for model in ("bloom", "opt"):  # ALiBi / learned offsets, no packed mask: refused
        torch.manual_seed(0)
        with pytest.raises(ConfigError, match="attends across the pairs of a row"):
            _check_packing(build_model(model_config(f"hf:{model}", "tiny", vocab=257)), model)
    torch.manual_seed(0)
    _check_packing(build_model(model_config("hf:llama", "tiny", vocab=257)), "llama")


def test_the_layout_is_packed_only_for_a_causal_lm_on_pairs(data, tmp_path, capsys):
    cfg = sized_config("hf:llama", "tiny", data, {"packed": True})
    assert layout_of("hf:llama", cfg, data) is Layout.PACKED_SHIFTED
    text = prepare(tmp_path / "text", stdlib_sources(1))
    common = ["--size", "tiny", "--steps", "1", "--lr-schedule", "constant",
              "--warmup-steps", "0", "--devices-per-node", "1", "--tp", "1", "--pp", "1"]
    cases = [(["--hf", "llama", "--pack", "--data", text], "holds text"),
             (["--hf", "t5", "--pack", "--data", data], "is an encoder-decoder"),
             (["--model", "bert", "--pack", "--data", data], "bert is not one"),
             (["--hf", "bloom", "--pack", "--data", data], "attends across the pairs"),
             (["--model", "moe", "--pack", "--capacity-factor", "1.25", "--data", data],
              "leave --capacity-factor out (dropless) to pack")]
    for flags, says in cases:
        out = tmp_path / "out"
        assert main(["-q", "train", *flags, "--out", str(out), *common]) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
        assert not out.exists()


def test_a_resume_keeps_the_packing_of_the_run(data, tmp_path, capsys):
    """The rows a step reads differ packed and not: a resume that changes
    --pack is one line (the data would not go on where it stopped)."""
    common = ["--hf", "llama", "--size", "tiny", "--data", data, "--out", str(tmp_path / "run"),
              "--devices-per-node", "1", "--tp", "1", "--pp", "1", "--vpp", "1",
              "--seq-len", str(SEQ), "--global-batch-size", "4", "--eval-every", "0",
              "--sample-tokens", "0", "--lr-schedule", "constant", "--warmup-steps", "0"]
    assert main(["-q", "train", *common, "--pack", "--steps", "2", "--checkpoint-every", "2"]) == 0
    capsys.readouterr()
    assert main(["-q", "train", *common, "--steps", "4", "--resume"]) == 2
    assert "resume with --pack" in capsys.readouterr().err
    assert main(["-q", "train", *common, "--pack", "--steps", "4", "--resume"]) == 0
