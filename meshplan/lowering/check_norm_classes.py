"""Proof 8 (the gradient norm counts every trained parameter exactly once)
argued over plan classes, for a whole directory: the work is the classes
and their pieces, not the ranks.

What a member of a class sums. The members of a class (stage, coordinates
on the fixed axes) run one body at different coordinates on the free axes
(`lowering/classes.py`). So they count the same grad_sq terms, each the
slice its layout gives the member, and reduce them by the same chain of
all-reduces, each over a line through the member: along an axis, or across
stages at its own coordinate. After k of them a member holds the sum of a
multiset of members' counted pieces, the same multiset relative to each
member: entries (class, summed free axes), the free axes not summed being
the member's own coordinates. An all-reduce along
- a free axis a: every line member is of this class and holds this
  pattern, so a becomes summed (an axis summed already is counted again:
  the multiplicity grows by its size);
- a fixed axis, or across stages: the line's members are other classes at
  the same free coordinates, so their patterns add as they are.

What a pattern's pieces are, for a member whose free coordinates are x on
the axes not summed: per counted term, the layout's box with the summed
axes' cuts left uncut (their parts partition what they cut: `split_range`),
each summed axis the term replicates counted once per rank of it (counted
once when its variant is REPLICA_FIRST: only the axis's first rank counts),
and enumerated where a later, unsummed axis cuts the same dim again (the
parts are then strided). Everything else a box depends on is x, and only
through x itself on the axes some term cuts, or through whether x is 0 on
the others (REPLICA_FIRST). So the pieces are tiled for every member when
they are for x in {0, 1} on the latter axes and in every coordinate on the
former (usually none: a final sum runs over every axis that cuts a term).

A chain holding a group that is neither a line nor across stages is not
argued here: the caller reads every rank (`check_norm.norm_coverage`).
"""

from __future__ import annotations

import itertools
from collections import Counter

from meshplan.ir.job import Job
from meshplan.ir.sbp import Shard, split_axis
from meshplan.lowering.check_norm import (
    FIRST,
    norm_terms,
    producers,
    tiling_errors,
    trained_shapes,
)


def norm_over_classes(job: Job, classes: dict[str, tuple], fixed: tuple[int, ...]
                      ) -> list[str] | None:
    """Errors of proof 8 over `classes` (class -> (stage, fixed coordinates,
    its representative's RankPlan, its body's group names per task)); None
    when a chain is not made of lines or cross-stage groups."""
    g, s = job.graph, job.strategy
    grid = s.grid
    free = tuple(a for a in range(len(grid)) if a not in fixed)
    producer, trained = producers(g), trained_shapes(g)
    class_at = {(st, f): k for k, (st, f, _, _) in classes.items()}
    errors: list[str] = []
    chains: dict[str, list] = {}
    terms: dict[str, list] = {}
    for k, (_, _, rep, refs) in sorted(classes.items(), key=lambda kv: kv[1][2].rank):
        got = norm_terms(g, producer, rep.tasks)
        if isinstance(got, str):
            errors.append(f"rank {rep.rank} (and its class): {got}")
        if got is None or isinstance(got, str):
            continue
        chain, terms[k] = got
        index = {t.op: i for i, t in enumerate(rep.tasks)}
        chains[k] = [refs[index[t.op]] for t in chain]
    if errors or not chains:
        return errors
    if len({len(c) for c in chains.values()}) > 1:
        return ["the ranks' norms are reduced by different numbers of all-reduces; "
                "recompile the plan"]
    if any(ref[0] not in ("axis", "stages") for c in chains.values() for ref in c):
        return None
    held: dict[str, Counter] = {k: Counter({(k, frozenset()): 1}) for k in chains}
    for step in range(len(next(iter(chains.values())))):
        new: dict[str, Counter] = {}
        for k, chain in chains.items():
            stage, f = classes[k][0], classes[k][1]
            ref = chain[step]
            if ref[0] == "axis" and ref[1] in free:
                a, n = ref[1], grid[ref[1]]
                new[k] = Counter({(k2, summed | {a}): times * (n if a in summed else 1)
                                  for (k2, summed), times in held[k].items()})
                continue
            if ref[0] == "axis":  # a fixed axis: this stage's classes along it
                at = [(stage, _with(f, fixed, ref[1], c)) for c in range(grid[ref[1]])]
            else:
                at = [(st, f) for st in ref[1]]
            total: Counter = Counter()
            for place in at:
                if class_at.get(place) in held:  # (a stage without a norm adds nothing)
                    total.update(held[class_at[place]])
            new[k] = total
        held = new
    seen: dict[frozenset, list[str]] = {}
    for k, pattern in sorted(held.items(), key=lambda kv: classes[kv[0]][2].rank):
        key = frozenset(pattern.items())
        if key not in seen:
            seen[key] = _pattern_errors(job, pattern, classes, terms, trained, fixed, free)
        rep = classes[k][2].rank
        errors += [f"rank {rep} (and its class): the gradient norm {e}" for e in seen[key][:3]]
    return errors


def _with(f: tuple[int, ...], fixed: tuple[int, ...], axis: int, c: int) -> tuple[int, ...]:
    return tuple(c if a == axis else x for a, x in zip(fixed, f))


def _pattern_errors(job, pattern: Counter, classes, terms, trained, fixed, free) -> list[str]:
    """The tiling errors of `pattern` for every member holding it: at x in
    {0, 1} on each unsummed free axis no term cuts, every x on those some
    term cuts (the first x with errors reported)."""
    grid = job.strategy.grid
    cutting = {a for (k, _), _ in pattern.items() for _, vid, _ in terms[k]
               for a, p in enumerate(job.sbp[vid]) if isinstance(p, Shard) and grid[a] > 1}
    pinned = sorted({a for (_, summed), _ in pattern.items() for a in free
                     if a not in summed and grid[a] > 1})
    choices = [range(grid[a]) if a in cutting else range(2) for a in pinned]
    for xs in itertools.product(*choices):
        x = dict(zip(pinned, xs))
        pieces: dict[str, list] = {name: [] for name in trained}
        for (k, summed), times in pattern.items():
            coord = [0] * len(grid)
            for a, c in zip(fixed, classes[k][1]):
                coord[a] = c
            for a, c in x.items():
                coord[a] = c
            for name, vid, variant in terms[k]:
                got = _pieces(job, vid, variant, coord, summed)
                pieces.setdefault(name, []).extend(got * times)
        errs = tiling_errors(pieces, trained)
        if errs:
            return errs
    return []


def _pieces(job, vid: int, variant: tuple, coord: list[int], summed: frozenset) -> list:
    """The boxes of term `vid` counted by the members at `coord` with the
    axes `summed` taking every value (one box per count)."""
    shape, sbp, grid = job.graph.values[vid].meta.shape, job.sbp[vid], job.strategy.grid
    if any(tag == FIRST and c != 0 and a not in summed
           for a, (tag, c) in enumerate(zip(variant, coord))):
        return []  # a replica the axis's first rank counts
    boxes = [tuple((0, n) for n in shape)]
    times = 1
    for a, p in enumerate(sbp):
        first = a < len(variant) and variant[a] == FIRST
        if a not in summed or first:  # this member's part (the first rank's, REPLICA_FIRST)
            c = 0 if a in summed else coord[a]
            boxes = [split_axis(b, p, grid[a], c) for b in boxes]
        elif not isinstance(p, Shard):
            times *= grid[a]  # every rank of the axis counts the same box
        elif any(isinstance(q, Shard) and q.dim == p.dim and later not in summed
                 for later, q in enumerate(sbp) if later > a):
            boxes = [split_axis(b, p, grid[a], c) for b in boxes for c in range(grid[a])]
        # else: the axis's parts partition the box, left uncut
    return boxes * times

