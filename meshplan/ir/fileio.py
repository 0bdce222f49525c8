"""Files meshplan writes: atomic, versioned, checksummed JSON envelopes.

Invariants:
- A file is written whole or not at all: `write_atomic` writes a temp file
  in the target's directory, fsyncs it and `os.replace`s it into place; on
  any failure the temp file is removed. Readers never see a partial file.
- A sealed file is one line of ASCII JSON,
  `{"format":K,"version":V,"sha256":H,"body":B}` plus a newline, where B is
  the canonical JSON of the body (sorted keys, no spaces, no NaN/Infinity)
  and H the sha256 of B. Sealing the same body twice gives the same bytes.
- `unseal` accepts only the expected format and version, and only a body
  whose canonical bytes still match H. The checksum catches corruption and
  stray edits; it is not a signature.
- A file in parts (`seal_parts`, for the Job) is the same envelope with an
  `index` before the body: the body is a JSON object whose members are
  written one by one, the index gives each member's byte range in the body,
  and H is the sha256 of the body's raw bytes. A reader checks H with one
  hash over the bytes (no re-encoding), and may then decode only the parts
  it needs. The whole file is still one JSON document.
- Every failure to read is a `PlanError` of one line: what, where, and how
  to fix it. Nothing here uses pickle: reading a file never runs code.
- Two writers stream: `atomic_stream` (a file too large to hold in memory,
  such as a token split, written through a temp file renamed into place on
  success, like `write_atomic`), and `LineLog` (an append-only log of whole
  lines, each flushed as written: a reader sees whole lines, and at most one
  last line still being written, which a reader skips).
- A directory of files is written into a temporary sibling and renamed into
  place only when all of it is there (`staged_directory`); a file another
  tool writes (a compiler's shared library) is made in a scratch sibling
  directory and renamed into place (`built_file`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from meshplan.errors import PlanError

_NEW_FILE_MODE = 0o644  # mkstemp makes 0o600; plan files are read by every rank


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one.

    Raises `PlanError` when the file cannot be written; no temp file is left
    behind, whatever fails."""
    try:
        with atomic_stream(path) as f:
            f.write(data)
    except OSError as e:
        raise PlanError(f"cannot write {path}: {e.strerror or e}; "
                        "check that its directory exists and is writable") from e


def write_staged(path: str | os.PathLike, data: bytes) -> None:
    """Write a file inside a staging directory that is published whole once
    every file is in (readers never see it before): a plain write, no temp
    file and no fsync of its own; the publisher syncs once (`os.sync`):
    a per-file fsync is most of `write_atomic`'s cost."""
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise PlanError(f"cannot write {path}: {e.strerror or e}; "
                        "check that its directory exists and is writable") from e


@contextlib.contextmanager
def atomic_stream(path: str | os.PathLike):
    """A binary file object whose bytes become `path` only when the block
    ends without an exception (temp file, fsync, `os.replace`; the file's
    mode kept if it existed); else nothing is left behind."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        mode = _NEW_FILE_MODE
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp: str | None = name
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(name, path)
        tmp = None
        _fsync_dir(path.parent)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@contextlib.contextmanager
def built_file(path: str | os.PathLike, mode: int = 0o755):
    """Yield a scratch directory beside `path`, for a tool that writes a file
    (and by-products of its own) itself: the file the block leaves at
    `scratch / path.name` becomes `path` atomically once the block ends
    without an error (`mode`: a shared library's, by default); the scratch
    directory is removed either way."""
    out = Path(path)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        yield scratch
        os.chmod(scratch / out.name, mode)
        os.replace(scratch / out.name, out)
        _fsync_dir(out.parent)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(path: str | os.PathLike):
    """Yield a new temporary sibling directory of `path`; once the block ends
    without an error it is put at `path` (replacing what is there only then),
    else it is removed, with any parent this call created: a directory is
    never seen half written."""
    out = Path(path)
    made = [p for p in out.absolute().parents if not p.exists()]
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.absolute().parent))
    try:
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp's 0o700 would hide it from others
        yield tmp
        if out.exists() and any(out.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.absolute().parent))
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)  # onto an empty directory too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made:
            if p.exists() and not any(p.iterdir()):
                p.rmdir()
        raise


def write_torch(path: str | os.PathLike, obj) -> None:
    """`torch.save(obj)` to `path`, atomically (a state_dict for people and
    tools; the one meshplan reads back, a checkpoint's unread weights, it
    loads `weights_only` once its sha256 is checked: `driver/unread.py`)."""
    with atomic_stream(path) as f:
        torch.save(obj, f)


class LineLog:
    """An append-only log of lines at `path`, each written whole and
    flushed; `close()` when done. Without `append` the file starts empty;
    with it, a half-written last line (a killed writer's) is cut first, so
    the next line starts on a line of its own."""

    def __init__(self, path: str | os.PathLike, append: bool = True):
        self.path = Path(path)
        if append:
            _drop_torn_line(self.path)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def write(self, line: str) -> None:
        """Append `line` (no newline in it) and flush it."""
        assert "\n" not in line
        self._file.write(line + "\n")
        self._file.flush()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        self._file.close()


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, wait: bool = True):
    """An exclusive lock on the empty file `path` (made if missing), held
    for the block: processes of one machine taking the same path run their
    blocks one at a time. Yields whether it holds the lock: with `wait`
    False it does not wait for another holder (False then). Without POSIX
    locks (no `fcntl`) it locks nothing."""
    try:
        import fcntl  # reason: POSIX only
    except ImportError:
        yield True
        return
    with open(path, "a") as f:  # nothing is written: the file is the lock's name
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _drop_torn_line(path: Path) -> None:
    try:
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        pass


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (best effort: not every OS allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def canonical(body: dict) -> bytes:
    """The canonical bytes of a JSON body: what the checksum covers."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return text.encode("ascii")


def seal(kind: str, version: int, body: dict) -> bytes:
    """Wrap `body` in a checksummed envelope; deterministic byte for byte.

    `body` must hold JSON types only, with finite floats (ValueError if not:
    that is a bug in the caller's encoder)."""
    data = canonical(body)
    head = (f'{{"format":{json.dumps(kind)},"version":{int(version)},'
            f'"sha256":"{hashlib.sha256(data).hexdigest()}","body":')
    return head.encode("ascii") + data + b"}\n"


def unseal(data: bytes, kind: str, version: int, where: str) -> dict:
    """Check an envelope written by `seal` and return its body.

    `where` (the file path) goes into every error message."""
    env = _parse(data, where)
    if not isinstance(env, dict) or not {"format", "version", "sha256", "body"} <= env.keys():
        raise _unreadable(where)
    got_kind, got_version, digest, body = (env["format"], env["version"], env["sha256"],
                                           env["body"])
    _check_kind(got_kind, got_version, kind, version, where)
    if not isinstance(body, dict) or not isinstance(digest, str):
        raise _unreadable(where)
    try:
        actual = hashlib.sha256(canonical(body)).hexdigest()
    except (ValueError, RecursionError):  # e.g. 1e999 edited in: not canonical
        actual = ""
    if actual != digest:
        raise PlanError(f"{where}: checksum mismatch: the file was edited or corrupted; "
                        "recompile it")
    return body


_PART_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)
_BODY = b'},"body":'


def encode_part(value) -> bytes:
    """One part's canonical JSON bytes (as `canonical`, for any JSON value)."""
    return _PART_ENCODER.encode(value).encode("ascii")


def seal_parts(kind: str, version: int, parts: dict[str, bytes]) -> bytes:
    """An envelope whose body is the object {name: part} of already encoded
    parts (`encode_part`), with each part's byte range in an index."""
    return sealed_parts(kind, version, parts).data


def sealed_parts(kind: str, version: int, parts: dict[str, bytes]) -> Parts:
    """`seal_parts`, kept open: the bytes, the index and the digest, hashed once."""
    body, index, at = [b"{"], {}, 1
    for i, (name, data) in enumerate(parts.items()):
        key = (b"," if i else b"") + json.dumps(name).encode("ascii") + b":"
        index[name] = [at + len(key), at + len(key) + len(data)]
        body += [key, data]
        at += len(key) + len(data)
    body.append(b"}")
    raw = b"".join(body)
    digest = hashlib.sha256(raw).hexdigest()
    head = (f'{{"format":{json.dumps(kind)},"version":{int(version)},"sha256":"{digest}",'
            f'"index":{json.dumps(index, separators=(",", ":"))}')
    return Parts(head.encode("ascii") + _BODY[1:] + raw + b"}\n", raw, index, digest,
                 f"<{kind}>")


class Parts:
    """A checked file in parts: its bytes, its digest (the body's sha256)
    and each part's decoded JSON on demand."""

    def __init__(self, data: bytes, body: bytes, index: dict, digest: str, where: str):
        self.data, self.body, self.index, self.digest = data, body, index, digest
        self.where = where

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def load(self, name: str):
        start, end = self.index[name]
        try:
            return json.loads(self.body[start:end], parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise _unreadable(self.where) from None


def open_parts(data: bytes, kind: str, version: int, where: str) -> Parts:
    """Check an envelope written by `seal_parts`: kind, version, and the
    body's hash over its raw bytes. Parts are decoded later, on demand."""
    cut = data.find(_BODY)  # the index's closing brace, then the body: found only there
    if cut < 0 or not data.endswith(b"}\n"):
        raise _unreadable(where)
    cut += 1
    env = _parse(data[:cut] + b"}", where)
    if not isinstance(env, dict) or not {"format", "version", "sha256"} <= env.keys():
        raise _unreadable(where)
    _check_kind(env["format"], env["version"], kind, version, where)
    body, index = data[cut + len(_BODY) - 1:-2], env.get("index")
    if not isinstance(index, dict) or not all(
            isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
            and 0 <= r[0] <= r[1] <= len(body) for r in index.values()):
        raise _unreadable(where)
    digest = hashlib.sha256(body).hexdigest()
    if digest != env["sha256"]:
        raise PlanError(f"{where}: checksum mismatch: the file was edited or corrupted; "
                        "recompile it")
    return Parts(data, body, index, digest, where)


def _check_kind(got_kind, got_version, kind: str, version: int, where: str) -> None:
    if got_kind != kind:
        raise PlanError(f"{where} is a {_short(got_kind)} file, not a {kind!r} file; "
                        "pass the right file, or recompile it")
    if type(got_version) is not int:
        raise _unreadable(where)
    if got_version != version:
        raise PlanError(f"{where} was written by format version {got_version}, this meshplan "
                        f"reads version {version}; recompile it with this version")


def read_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of the file at `path`; a one-line `PlanError` if unreadable."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise PlanError(f"{path} does not exist; check the path, or compile it first") from None
    except OSError as e:
        raise PlanError(f"cannot read {path}: {e.strerror or e}; check its permissions") from e


def read_sealed(path: str | os.PathLike, kind: str, version: int) -> dict:
    """Read the file at `path` and `unseal` it."""
    return unseal(read_bytes(path), kind, version, str(path))


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def _parse(data: bytes, where: str):
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _unreadable(where) from None


def _unreadable(where: str) -> PlanError:
    return PlanError(f"{where} is truncated or not a meshplan file; recompile it")


def _short(x) -> str:
    """A value read from a file, made safe for a one-line message."""
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
