"""The pictures: the schedule and the loss curves are PNGs a person can read."""

import numpy as np
import pytest

from meshplan.cli.pictures import _HUES, _shade, draw_losses
from meshplan.cli.show_cmd import schedule_png
from meshplan.driver.compile import compile_job
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.mesh import Mesh
from meshplan.lowering.files import read_dir
from meshplan.models import model_config
from meshplan.schedules.action import ActionType

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_real_png(path, min_colours: int) -> np.ndarray:
    """A valid PNG (signature, decodes) that is not blank: many distinct colours."""
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
    colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) >= min_colours, len(colours)
    return img


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, pp=2, vpp=2, global_batch_size=4, micro_batch_size=1)
    out = tmp_path_factory.mktemp("plans")
    compile_job(plan_model("gpt", "tiny", Mesh(1, 2), s).job, out, workers=1, use_cache=False)
    return (*read_dir(out), out)


def test_schedule_png_has_one_colour_per_chunk(plans, tmp_path):
    job, ranks, _ = plans
    r = schedule_png(job, ranks, tmp_path / "schedule.png")
    assert r["bubble_ratio"] > 0
    img = assert_real_png(tmp_path / "schedule.png", min_colours=50)
    pixels = np.unique((img[..., :3] * 255).round().astype(int).reshape(-1, 3), axis=0)
    assert_shades(pixels, {ActionType.F, ActionType.B})
    white = (img[..., :3] > 0.99).all(axis=-1).mean()
    assert 0.2 < white < 0.95  # bubbles and margins are white, but not everything


def assert_shades(pixels, drawn: set) -> None:
    """Each chunk's hue appears in the shade of every kind `drawn`."""
    for chunk in (0, 1):
        for kind in drawn:
            want = np.array(_shade(_HUES[chunk], kind)) * 255
            assert (np.abs(pixels - want).sum(axis=1) <= 6).any(), (chunk, kind)


def test_zero_bubble_png_draws_i_and_w_in_their_own_shades(tmp_path):
    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, pp=2, vpp=2, schedule="zbv", global_batch_size=4,
                     micro_batch_size=1)
    compile_job(plan_model("gpt", "tiny", Mesh(1, 2), s).job, tmp_path / "p", workers=1,
                use_cache=False)
    job, ranks = read_dir(tmp_path / "p")
    schedule_png(job, ranks, tmp_path / "zbv.png")
    img = assert_real_png(tmp_path / "zbv.png", min_colours=50)
    pixels = np.unique((img[..., :3] * 255).round().astype(int).reshape(-1, 3), axis=0)
    assert_shades(pixels, {ActionType.F, ActionType.I, ActionType.W})


def test_losses_png(tmp_path):
    steps = list(range(10))
    mine = [5 - 0.1 * i for i in steps]
    draw_losses(steps, mine, [x + 1e-7 for x in mine], tmp_path / "losses.png", "GPT tiny")
    assert_real_png(tmp_path / "losses.png", min_colours=30)


def test_many_ranks_draw_one_row_per_stage():
    from meshplan.cli.pictures import MAX_ROWS, rows_of

    spans = {0: [], 1: []}
    few = rows_of(spans, {0: [0, 1], 1: [2, 3]})
    assert [label for label, _ in few] == ["rank 0 (stage 0)", "rank 1 (stage 0)",
                                           "rank 2 (stage 1)", "rank 3 (stage 1)"]
    half = MAX_ROWS // 2 + 1
    many = rows_of(spans, {0: list(range(half)), 1: list(range(half, 2 * half))})
    assert [label for label, _ in many] == [f"stage 0: {half} ranks", f"stage 1: {half} ranks"]


def test_a_picture_path_that_cannot_be_written_is_one_line(plans, tmp_path):
    from tests.cli.test_cli import assert_user_error, run

    bad = tmp_path / "missing" / "dir" / "s.png"
    assert_user_error(run("show", str(plans[2]), "--png", str(bad)), "cannot use")


def _training_rows(evals: bool) -> list[dict]:
    rows = [{"kind": "train", "step": s, "loss": 6.0 * 0.97 ** s + 0.05 * (s % 3)}
            for s in range(60)]
    rows[30]["loss"] = None  # a NaN step: a gap, not a point
    if evals:
        rows += [{"kind": "eval", "step": s, "eval_loss": 6.1 * 0.97 ** s, "eval_ppl": None}
                 for s in range(0, 60, 10)]
    return rows


def test_training_png(tmp_path):
    from meshplan.cli.pictures import draw_training

    path = draw_training(_training_rows(evals=True), tmp_path / "loss.png", reference=4.2,
                         reference_label="unigram entropy")
    assert path == tmp_path / "loss.png" and path.stat().st_size > 0
    img = assert_real_png(path, min_colours=30)
    eval_orange = np.array([0xD5, 0x5E, 0x00]) / 255
    assert (np.abs(img[..., :3] - eval_orange).sum(axis=-1) < 0.05).any()
    assert not list(tmp_path.glob(".*.tmp"))


def test_training_png_without_eval_rows_or_reference(tmp_path):
    from meshplan.cli.pictures import draw_training

    path = draw_training(_training_rows(evals=False), tmp_path / "loss.png")
    assert_real_png(path, min_colours=20)
    draw_training([], tmp_path / "empty.png")  # no rows yet: an empty frame, no error
    assert (tmp_path / "empty.png").stat().st_size > 0
