"""Bad input gets one clear error, exits non-zero, and changes nothing in the store."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import cas
from tests.helpers import chunk_files, local_root


def run_cli(store: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(store), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], needle: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cas: error:"), result.stderr
    assert needle in lines[0], lines[0]


class Evil:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.sentinel}",))


@pytest.mark.parametrize("as_torch_zip", [False, True])
def test_put_refuses_a_pickle_that_would_run_code(tmp_path: Path, as_torch_zip: bool) -> None:
    store = tmp_path / "store"
    cas.open(store)
    sentinel = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    if as_torch_zip:
        torch.save({"w": torch.ones(2), "payload": Evil(sentinel)}, evil)
    else:
        evil.write_bytes(pickle.dumps({"payload": Evil(sentinel)}))
    result = run_cli(store, "put", str(evil), "runs/evil")
    assert_one_line_error(result, "evil.pt")
    assert not sentinel.exists()
    assert not cas.open(store).refs()
    assert not (store / "chunks").exists() or not any((store / "chunks").rglob("*"))


def test_bad_ref_names_are_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    source = tmp_path / "f.bin"
    source.write_bytes(b"x" * 100)
    for bad in ["../x", "/abs/ref", "a//b", "a/./b", "a/../b", "", "a/", "bad\x01name"]:
        with pytest.raises(cas.InvalidName):
            cas.open(store).save({"w": torch.ones(1)}, bad)
    for bad in ["../x", "/abs", "a//b"]:
        assert_one_line_error(run_cli(store, "put", str(source), bad), "ref name")
    assert not cas.open(store).refs()


def test_unknown_ref_is_one_clear_error(tmp_path: Path) -> None:
    store = tmp_path / "store"
    cas.open(store).save({"w": torch.ones(1)}, "runs/a")
    for args in (
        ["get", "runs/nope", str(tmp_path / "out")],
        ["show", "runs/nope"],
        ["log", "runs/nope"],
        ["cp", "runs/nope", "x"],
        ["rm", "runs/nope"],
    ):
        assert_one_line_error(run_cli(store, *args), "runs/nope")


def test_truncated_safetensors_is_refused_and_nothing_stored(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = cas.open(store)
    good = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(256, 256)}, good)
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    before = chunk_files(repo)
    assert_one_line_error(run_cli(store, "put", str(truncated), "runs/t"), "t.safetensors")
    assert chunk_files(repo) == before
    assert not repo.refs()


def test_corrupted_manifest_is_a_clear_error(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = cas.open(store)
    repo.save({"w": torch.randn(10)}, "runs/m")
    manifest = next(p for p in (local_root(repo) / "manifests").rglob("*") if p.is_file())
    manifest.write_bytes(manifest.read_bytes()[:-7] + b"garbage")
    assert_one_line_error(run_cli(store, "show", "runs/m"), "IntegrityError")
    result = run_cli(store, "verify")
    assert result.returncode == 1 and "corrupt-manifest" in result.stderr


def test_a_store_of_an_unknown_version_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    cas.open(store)
    config = json.loads((store / "config").read_text())
    config["version"] = 99
    (store / "config").write_text(json.dumps(config))
    with pytest.raises(cas.FormatError, match="version 99"):
        cas.open(store)
    assert_one_line_error(run_cli(store, "ls"), "version 99")


def test_a_manifest_of_an_unknown_version_is_refused(tmp_path: Path) -> None:
    from cas.manifest import decode_manifest, encode_manifest

    repo = cas.open(tmp_path / "store")
    repo.save({"w": torch.ones(3)}, "r")
    data = encode_manifest(repo.manifest("r")).replace(b"\xa7version\x01", b"\xa7version\x07")
    with pytest.raises(cas.FormatError, match="version 7"):
        decode_manifest(data)


def test_hostile_manifest_paths_are_refused(tmp_path: Path) -> None:
    import msgpack

    from cas.manifest import decode_manifest

    for path in ["../../etc/passwd", "/etc/passwd", "a/../../b", "a\x00b"]:
        doc = {
            "format": "cas-manifest",
            "version": 1,
            "kind": "files",
            "tensors": [],
            "files": {path: {"size": 0, "format": "opaque", "chunks": []}},
        }
        with pytest.raises(cas.CASError):
            decode_manifest(msgpack.packb(doc))


def test_get_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    store = tmp_path / "store"
    source = tmp_path / "a.bin"
    source.write_bytes(os.urandom(1000))
    assert run_cli(store, "put", str(source), "files/a").returncode == 0
    target = tmp_path / "existing.bin"
    target.write_bytes(b"precious")
    assert_one_line_error(run_cli(store, "get", "files/a", str(target)), "--force")
    assert target.read_bytes() == b"precious"
    assert run_cli(store, "get", "files/a", str(target), "--force").returncode == 0
    assert target.read_bytes() == source.read_bytes()
