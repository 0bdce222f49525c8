"""Sealed files: every way a file can be bad is one clear PlanError."""

import hashlib
import json
import os

import pytest

from meshplan.errors import PlanError
from meshplan.ir import fileio
from meshplan.ir.fileio import read_sealed, seal, unseal, write_atomic

KIND = "meshplan.test"
BODY = {"b": [1, 2.0, None, True, "x"], "a": {"z": 1, "y": [{"$ref": 3}]}}


@pytest.fixture
def sealed(tmp_path):
    path = tmp_path / "plan.json"
    write_atomic(path, seal(KIND, 1, BODY))
    return path


def _plan_error(path, version=1, kind=KIND) -> str:
    with pytest.raises(PlanError) as info:
        read_sealed(path, kind, version)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_round_trip_and_determinism(sealed):
    assert read_sealed(sealed, KIND, 1) == BODY
    reordered = {"a": {"y": [{"$ref": 3}], "z": 1}, "b": [1, 2.0, None, True, "x"]}
    assert seal(KIND, 1, reordered) == sealed.read_bytes()
    env = json.loads(sealed.read_bytes())
    assert list(env) == ["format", "version", "sha256", "body"]
    assert env["sha256"] == hashlib.sha256(fileio.canonical(BODY)).hexdigest()


def test_seal_refuses_non_finite_floats():
    with pytest.raises(ValueError):
        seal(KIND, 1, {"x": float("nan")})


@pytest.mark.parametrize("keep", [0, 1, 20, 0.5, -2])
def test_truncated(sealed, keep):
    data = sealed.read_bytes()
    sealed.write_bytes(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    assert "is truncated or not a meshplan file; recompile it" in _plan_error(sealed)


@pytest.mark.parametrize("data", [b"\xff\xfe garbage", b"[1, 2]", b'{"format": 1}',
                                  b"\x80\x04\x95pickle", b"[" * 100_000],
                         ids=["binary", "list", "no-body", "pickle", "deeply-nested"])
def test_not_a_meshplan_file(sealed, data):
    sealed.write_bytes(data)
    assert "truncated or not a meshplan file" in _plan_error(sealed)


def test_flipped_byte_in_body(sealed):
    data = bytearray(sealed.read_bytes())
    i = data.index(b'"x"') + 1
    data[i] ^= 0x01  # "x" -> "y": still valid JSON
    sealed.write_bytes(bytes(data))
    assert "checksum mismatch: the file was edited or corrupted; recompile it" in \
        _plan_error(sealed)


def test_edited_body_with_made_up_checksum(sealed):
    env = json.loads(sealed.read_bytes())
    env["body"]["b"][0] = 2
    env["sha256"] = hashlib.sha256(b"something else").hexdigest()
    sealed.write_text(json.dumps(env))
    assert "checksum mismatch" in _plan_error(sealed)


def test_reformatted_but_unchanged_body_still_reads(sealed):
    env = json.loads(sealed.read_bytes())
    sealed.write_text(json.dumps(env, indent=2))
    assert read_sealed(sealed, KIND, 1) == BODY


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"1e999"])
def test_non_finite_number_edited_in(sealed, token):
    sealed.write_bytes(sealed.read_bytes().replace(b"2.0", token))
    msg = _plan_error(sealed)
    assert "checksum mismatch" in msg or "not a meshplan file" in msg


def test_other_version(tmp_path):
    path = tmp_path / "v3.json"
    write_atomic(path, seal(KIND, 3, BODY))
    msg = _plan_error(path)
    assert "written by format version 3, this meshplan reads version 1" in msg
    assert msg.endswith("recompile it with this version")


def test_wrong_kind(sealed):
    msg = _plan_error(sealed, kind="meshplan.graph")
    assert "'meshplan.test'" in msg and "not a 'meshplan.graph' file" in msg


def test_hostile_kind_stays_one_line(sealed):
    env = json.loads(sealed.read_bytes())
    env["format"] = "evil\n" * 50
    sealed.write_text(json.dumps(env))
    assert len(_plan_error(sealed)) < 300 + len(str(sealed))


def test_missing_file(tmp_path):
    msg = _plan_error(tmp_path / "nope.json")
    assert "does not exist" in msg


def test_directory_instead_of_file(tmp_path):
    assert "cannot read" in _plan_error(tmp_path)


def test_unseal_names_where():
    with pytest.raises(PlanError, match=r"^<stdin> is truncated"):
        unseal(b"{", KIND, 1, "<stdin>")


def test_write_atomic_replaces_whole_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    write_atomic(path, b"new contents")
    assert path.read_bytes() == b"new contents"
    assert os.stat(path).st_mode & 0o777 == 0o640  # keeps the old file's mode
    assert os.listdir(tmp_path) == ["f.bin"]
    write_atomic(tmp_path / "g.bin", b"x")
    assert os.stat(tmp_path / "g.bin").st_mode & 0o777 == 0o644  # not mkstemp's 0o600


def test_failed_replace_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def boom(src, dst):
        assert os.path.exists(src)  # the temp file was really written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(PlanError, match=r"cannot write .*f\.bin: No space left on device"):
        write_atomic(path, b"new")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_failed_write_leaves_no_temp(tmp_path, monkeypatch):
    def boom(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "f.bin", b"new")
    assert os.listdir(tmp_path) == []


def test_write_into_missing_directory(tmp_path):
    with pytest.raises(PlanError, match="check that its directory exists"):
        write_atomic(tmp_path / "no" / "f.bin", b"x")


# ---- files in parts (the Job, rank plans) ------------------------------------------------

def _parts_file() -> bytes:
    from meshplan.ir.fileio import encode_part, seal_parts
    return seal_parts(KIND, 2, {"head": encode_part({"n": 2}), "body": encode_part([[1, 2], "x"])})


def test_parts_round_trip_hash_once_and_stay_one_json_document():
    from meshplan.ir.fileio import open_parts
    data = _parts_file()
    parts = open_parts(data, KIND, 2, "f")
    assert parts.load("head") == {"n": 2} and parts.load("body") == [[1, 2], "x"]
    doc = json.loads(data)  # tools can still read it as JSON
    assert doc["body"] == {"head": {"n": 2}, "body": [[1, 2], "x"]}
    body = data[data.index(b'},"body":') + len(b'},"body":'):-2]  # the raw body bytes
    assert parts.body == body
    assert parts.digest == doc["sha256"] == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize("damage, phrase", [
    (lambda d: d.replace(b"[1,2]", b"[1,3]"), "checksum mismatch"),
    (lambda d: d[:-5], "truncated"),
    (lambda d: d.replace(b'"version":2', b'"version":3'), "format version 3"),
    (lambda d: d.replace(KIND.encode(), b"other.kind"), "not a"),
    (lambda d: d.replace(b'"head":[', b'"head":[9999', 1), "truncated"),
])
def test_damaged_parts_are_one_line_errors(damage, phrase):
    from meshplan.ir.fileio import open_parts
    with pytest.raises(PlanError, match=phrase):
        open_parts(damage(_parts_file()), KIND, 2, "f")
