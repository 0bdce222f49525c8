"""Plan directories and checkpoints for the catalogue, and the ways to
damage them. The good ones are made once per session; each case copies one
into its own tmp_path and damages the copy."""

from __future__ import annotations

import shutil
from pathlib import Path

from meshplan.driver.compile import compile_job
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.fileio import encode_part, open_parts, seal_parts
from meshplan.ir.job import KIND as JOB_KIND
from meshplan.ir.job import VERSION as JOB_VERSION
from meshplan.ir.mesh import Mesh
from meshplan.lowering.files import (
    JOB_FILE,
    KIND,
    VERSION,
    class_bytes,
    class_name,
    open_class,
    open_head,
    plan_name,
)
from meshplan.models import build_model, model_config

# The good plan directory: gpt tiny on 2 ranks, pp=2 (so it has send/recv).
PLAN_FLAGS = ("--model", "gpt", "--devices-per-node", "2", "--pp", "2",
              "--global-batch-size", "8", "--micro-batch-size", "2")


def make_plans(out: Path) -> None:
    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, pp=2, global_batch_size=8, micro_batch_size=2)
    compile_job(plan_model("gpt", "tiny", Mesh(1, 2), s).job, out, workers=1, use_cache=False)


def make_checkpoint(out: Path) -> None:
    """A checkpoint of gpt tiny on one rank (SGD), saved in this process."""
    from meshplan.lowering.lower import lower
    from meshplan.runtime import checkpoint
    from meshplan.runtime.rank_executor import RankExecutor

    cfg = model_config("gpt", "tiny")
    s = zoo_strategy("gpt", cfg, global_batch_size=8, micro_batch_size=8)
    job = plan_model("gpt", "tiny", Mesh(1, 1), s).job
    ex = RankExecutor(job, lower(job, 0))
    state = ex.init_state(build_model(cfg))
    checkpoint.save(str(out), checkpoint.stage(state, ex.ctx, 1), checkpoint.SavedJob(job),
                    next_step=1)


def copy_of(good: Path, tmp: Path, name: str) -> Path:
    dst = tmp / name
    shutil.copytree(good, dst)
    return dst


# ---- damage: each takes the copied directory ---------------------------------------------

def _plan(d: Path, rank: int = 1) -> Path:
    return d / plan_name(rank)


def truncate(d: Path) -> None:
    data = _plan(d).read_bytes()
    _plan(d).write_bytes(data[: len(data) // 2])


def flip_digit(d: Path) -> None:
    """One digit of the body changed: still JSON, no longer the sealed bytes."""
    data = bytearray(_plan(d).read_bytes())
    i = data.index(b'"body":') + len(data) // 2 // 2
    while not chr(data[i]).isdigit():
        i += 1
    data[i] = ord("7") if data[i] != ord("7") else ord("3")
    _plan(d).write_bytes(bytes(data))


def edit_rank_field(d: Path) -> None:
    """Hand-edited JSON: the rank changed, the checksum left stale."""
    data = _plan(d).read_bytes()
    _plan(d).write_bytes(data.replace(b'"rank":1', b'"rank":0', 1))


def other_version(d: Path) -> None:
    data = _plan(d).read_bytes()
    old, new = f'"version":{VERSION}', f'"version":{VERSION + 1}'
    _plan(d).write_bytes(data.replace(old.encode(), new.encode(), 1))


def drop_rank(d: Path) -> None:
    _plan(d).unlink()


def extra_rank(d: Path) -> None:
    shutil.copy(_plan(d), _plan(d, 2))


def _reseal(path: Path, kind: str, version: int, name: str, edit) -> None:
    """Part `name` of a sealed file edited by `edit(decoded)`, the file sealed
    again (a valid checksum over edited content)."""
    parts = open_parts(path.read_bytes(), kind, version, str(path))
    raw = {n: parts.body[a:b] for n, (a, b) in parts.index.items()}
    part = parts.load(name)
    edit(part)
    raw[name] = encode_part(part)
    path.write_bytes(seal_parts(kind, version, raw))


def reseal_malformed(d: Path) -> None:
    """Edited and resealed (a valid checksum) but not a plan head any more."""
    _reseal(_plan(d), KIND, VERSION, "head", lambda h: h.update(coord=5))


def reseal_wrong_peer(d: Path) -> None:
    """Rank 1's class body edited and stored as a class of its own (its head
    naming it): a receive now names the wrong peer, rank 1 itself."""
    head = open_head(_plan(d).read_bytes(), "head")
    body = open_class((d / class_name(head["class"])).read_bytes(), "body")
    task = next(t for t in body["tasks"] if t[0] == "recv")
    task[8] = [head["stage"], head["coord"]]  # rank 1 receives from itself
    digest, data = class_bytes(body)
    (d / class_name(digest)).write_bytes(data)
    _reseal(_plan(d), KIND, VERSION, "head", lambda h: h.update({"class": digest}))


def drop_job(d: Path) -> None:
    (d / JOB_FILE).unlink()


def plan_as_job(d: Path) -> None:
    shutil.copy(_plan(d, 0), d / JOB_FILE)


def reseal_job(d: Path) -> None:
    """job.json replaced by another (valid) Job: the plans were lowered from another."""
    _reseal(d / JOB_FILE, JOB_KIND, JOB_VERSION, "head",
            lambda head: head.update(notes=head["notes"] + ["edited"]))


def drop_complete(d: Path) -> None:
    (d / "COMPLETE").unlink()


def edit_complete(d: Path) -> None:
    data = (d / "COMPLETE").read_bytes()
    (d / "COMPLETE").write_bytes(data.replace(b'"next_step":1', b'"next_step":5', 1))


def edit_metadata(d: Path) -> None:
    """DCP's pickled index changed: it must never be unpickled."""
    with open(d / ".metadata", "ab") as f:
        f.write(b"\x80")
