"""Pictures for people: the pipeline schedule and the loss curves, as PNGs.

Invariants:
- matplotlib runs on the Agg backend (no display needed) and is imported
  only when a picture is asked for, so the command starts fast without it.
- The schedule picture has one row per rank (or per stage, beyond
  `MAX_ROWS` ranks); F, B, I and W boxes take one colour per chunk (the
  chunk of their stage in the schedule's stage placement) in their own
  shade of it: F light, W the hue itself, I dark, B darkest; labelled with
  their kind and micro-batch when the box is wide enough; a SEND is a
  triangle on the row's top edge, a RECV a tick on its bottom edge with a
  grey bar while it waits; bubbles stay white.
- The training picture (`draw_training`) reads metrics rows as
  `driver/metrics.py` writes them: a train loss that is null (NaN) is a gap
  in the line, not a point; it is written atomically (`write_atomic`).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path

from meshplan.ir.fileio import write_atomic
from meshplan.ir.stage_placement import StagePlacement
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.trace import Span, action_of

MAX_ROWS = 32
# One hue per chunk (colour-blind-safe Okabe-Ito order), one shade per compute kind.
_HUES = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442",
         "#000000"]
# (blend towards white, else scale towards black, amount) and the legend's word
_SHADES = {ActionType.F: (True, 0.45, "forward"), ActionType.W: (False, 1.0, "weight grad (W)"),
           ActionType.I: (False, 0.6, "input grad (I)"), ActionType.B: (False, 0.42, "backward")}
_DARK = (ActionType.I, ActionType.B)  # white labels


def _pyplot():
    import matplotlib  # optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional

    return plt


def _shade(hex_colour: str, kind: ActionType) -> tuple:
    """The chunk's colour in the shade of compute kind `kind` (see `_SHADES`)."""
    rgb = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    lighten, amount, _ = _SHADES[kind]
    return tuple(c + (1 - c) * amount if lighten else c * amount for c in rgb)


def rows_of(spans_by_stage: Mapping[int, Sequence[Span]],
            ranks_of_stage: Mapping[int, Sequence[int]]) -> list[tuple[str, Sequence[Span]]]:
    """(label, spans) per picture row: one per rank, or one per stage when
    there are more than `MAX_ROWS` ranks (all ranks of a stage act alike)."""
    total = sum(len(v) for v in ranks_of_stage.values())
    if total <= MAX_ROWS:
        rows = [(r, s) for s, ranks in ranks_of_stage.items() for r in ranks]
        return [(f"rank {r} (stage {s})", spans_by_stage[s]) for r, s in sorted(rows)]
    return [(f"stage {s}: {len(ranks)} ranks", spans_by_stage[s])
            for s, ranks in sorted(ranks_of_stage.items())]


def draw_schedule(rows: Sequence[tuple[str, Sequence[Span]]], placement: StagePlacement,
                  path: str | Path, title: str) -> Path:
    """Draw one step's timeline (seconds) as a PNG at `path`; returns the path."""
    plt = _pyplot()
    from matplotlib.lines import Line2D  # optional
    from matplotlib.patches import Patch  # optional

    end = max((s.end for _, spans in rows for s in spans), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(min(24, 8 + 0.08 * sum(len(s) for _, s in rows[:1])),
                                    1.2 + 0.55 * len(rows)), dpi=110)
    drawn: set[tuple[int, ActionType]] = set()  # (chunk, kind)
    for y, (_, spans) in enumerate(rows):
        for s in spans:
            a = action_of(s)
            if a is None:
                continue
            if a.type.is_compute or a.type is ActionType.STEP:
                drawn |= _draw_compute(ax, a, s, y, placement, end)
            else:
                _draw_comm(ax, a, s, y)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, end * 1.01)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_xlabel("time (ms)")
    ax.xaxis.set_major_formatter(lambda x, _: f"{x * 1e3:g}")
    ax.set_title(title)
    handles = [Patch(color=_shade(_HUES[c % len(_HUES)], kind),
                     label=f"chunk {c} {_SHADES[kind][2]}")
               for c, kind in sorted(drawn, key=lambda x: (x[0], list(_SHADES).index(x[1])))]
    handles.append(Patch(color="0.55", label="optimizer step"))
    handles.append(Patch(color="0.85", label="waiting on a receive"))
    handles.append(Line2D([], [], marker="v", color="black", linestyle="none", markersize=4,
                          label="send posted"))
    handles.append(Line2D([], [], marker="|", color="black", linestyle="none", markersize=6,
                          label="receive done"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=8,
              frameon=False)
    ax.grid(axis="x", color="0.9", linewidth=0.6)
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _draw_compute(ax, a: Action, s: Span, y: int, placement: StagePlacement,
                  end: float) -> set[tuple[int, ActionType]]:
    width = s.end - s.start
    if a.type is ActionType.STEP:
        ax.barh(y, width, left=s.start, height=0.7, color="0.55", edgecolor="white",
                linewidth=0.4)
        if width > end * 0.03:
            ax.text(s.start + width / 2, y, "step", ha="center", va="center", fontsize=7,
                    color="white")
        return set()
    chunk = placement.chunk_of(a.virtual_stage)
    ax.barh(y, width, left=s.start, height=0.7, color=_shade(_HUES[chunk % len(_HUES)], a.type),
            edgecolor="white", linewidth=0.4)
    if width > end * 0.012:
        ax.text(s.start + width / 2, y, f"{a.type.value}{a.microbatch}", ha="center",
                va="center", fontsize=6.5, color="white" if a.type in _DARK else "black")
    return {(chunk, a.type)}


def _draw_comm(ax, a: Action, s: Span, y: int) -> None:
    if a.type.is_send:
        ax.plot([s.start], [y - 0.38], marker="v", markersize=3.5, color="black",
                linestyle="none")
        return
    if s.end > s.start:
        ax.barh(y + 0.3, s.end - s.start, left=s.start, height=0.1, color="0.85")
    ax.plot([s.end, s.end], [y + 0.25, y + 0.4], color="black", linewidth=0.8)


def draw_losses(steps: Sequence[int], mine: Sequence[float], reference: Sequence[float],
                path: str | Path, title: str) -> Path:
    """meshplan's loss per step beside the eager reference's, as a PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4), dpi=110)
    ax.plot(steps, reference, color="#0072B2", linewidth=3.5, alpha=0.45,
            label="eager PyTorch, one process")
    ax.plot(steps, mine, color="#D55E00", marker="o", markersize=4, linewidth=1.2,
            label="meshplan, one process per rank")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the global batch)")
    ax.set_title(title)
    diff = max((abs(x - y) for x, y in zip(mine, reference)), default=0.0)
    ax.text(0.99, 0.02, f"max |diff| = {diff:.1e}", transform=ax.transAxes, ha="right",
            va="bottom", fontsize=9)
    ax.grid(color="0.9")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def draw_training(rows: Sequence[Mapping], path: str | Path, reference: float | None = None,
                  reference_label: str = "", title: str = "training loss") -> Path:
    """A training run's loss as a PNG at `path`: the train loss per step (a
    line), the eval loss at its steps (markers and a line), and a dashed
    line at `reference` (e.g. the unigram entropy) if given."""
    plt = _pyplot()
    train = [(r["step"], _nan_if_none(r.get("loss"))) for r in rows if r.get("kind") == "train"]
    evals = [(r["step"], r["eval_loss"]) for r in rows
             if r.get("kind") == "eval" and r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.4), dpi=110)
    if train:
        ax.plot(*zip(*train), color="#0072B2", linewidth=1.2, label="train loss")
    if evals:
        ax.plot(*zip(*evals), color="#D55E00", marker="o", markersize=5, linewidth=1.2,
                label="eval loss")
    if reference is not None:
        ax.axhline(reference, color="0.35", linestyle="--", linewidth=1.0,
                   label=f"{reference_label or 'reference'} ({reference:.3g})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the batch)")
    ax.set_title(title)
    ax.grid(color="0.9")
    ax.xaxis.get_major_locator().set_params(integer=True)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.tight_layout()
    data = io.BytesIO()
    fig.savefig(data, format="png")
    plt.close(fig)
    write_atomic(path, data.getvalue())
    return Path(path)


def _nan_if_none(value) -> float:
    return float("nan") if value is None else float(value)
