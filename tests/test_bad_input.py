"""Bad input gets one clear error, exits non-zero, and changes nothing in the store."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import cas
from tests.helpers import chunk_files, local_root, run_cli


def assert_one_line_error(result: subprocess.CompletedProcess[str], needle: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cas: error:"), result.stderr
    assert needle in lines[0], lines[0]


class Evil:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
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
    from cas.model.manifest import decode_manifest, encode_manifest

    repo = cas.open(tmp_path / "store")
    repo.save({"w": torch.ones(3)}, "r")
    data = encode_manifest(repo.manifest("r")).replace(b"\xa7version\x01", b"\xa7version\x07")
    with pytest.raises(cas.FormatError, match="version 7"):
        decode_manifest(data)


def test_hostile_manifest_paths_are_refused(tmp_path: Path) -> None:
    import msgpack

    from cas.model.manifest import decode_manifest

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


def test_a_file_name_a_manifest_cannot_hold_is_refused_and_the_store_stays_usable(
    tmp_path: Path,
) -> None:
    store, src = tmp_path / "store", tmp_path / "src"
    src.mkdir()
    (src / "a\tb").write_bytes(b"1")
    assert_one_line_error(run_cli(store, "put", str(src), "ok/dir"), "cannot store a file named")
    assert run_cli(store, "ls", "--json").returncode == 0
    assert run_cli(store, "gc", "--dry-run").returncode == 0


def test_get_refuses_before_writing_anything_it_cannot_finish(tmp_path: Path) -> None:
    store, src, out = tmp_path / "store", tmp_path / "src", tmp_path / "out"
    (src / "sub").mkdir(parents=True)
    (src / "a").write_text("a")
    (src / "sub" / "x").write_text("x")
    (src / "b.sha256").write_text("user notes")
    (src / "b").write_text("b")
    assert run_cli(store, "put", str(src), "d").returncode == 0
    out.mkdir()
    (out / "sub").write_text("mine")  # a file where the checkpoint needs a directory
    assert_one_line_error(run_cli(store, "get", "d", str(out), "--force"), "a directory is needed")
    assert sorted(p.name for p in out.iterdir()) == ["sub"]
    # --sha256 would write b.sha256 over the stored file of that name
    assert_one_line_error(run_cli(store, "get", "d", str(tmp_path / "o2"), "--sha256"), "sidecar")
    assert not (tmp_path / "o2").exists()


def test_rm_with_one_unknown_ref_removes_none(tmp_path: Path) -> None:
    store = tmp_path / "store"
    cas.open(store).save({"w": torch.ones(1)}, "gates/best")
    assert_one_line_error(run_cli(store, "rm", "gates/best", "runs/typo"), "runs/typo")
    assert [r.name for r in cas.open(store).refs()] == ["gates/best"]


def test_usage_errors_and_odd_store_paths_are_one_line(tmp_path: Path) -> None:
    store = tmp_path / "store"
    for args in (["put"], ["verify", "--sample", "abc"], ["get", "--format", "zip", "a", "b"]):
        result = run_cli(store, *args)
        assert result.returncode == 2
        assert_one_line_error(result, "--help")
    assert_one_line_error(run_cli(Path("~nosuchuser_zz/store"), "ls"), "nosuchuser_zz")


def test_init_never_ignores_options_silently(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert run_cli(store, "init", "--codec", "zstd").returncode == 0
    assert_one_line_error(run_cli(store, "init", "--codec", "raw"), "already exists")
    assert_one_line_error(run_cli(tmp_path / "other", "init", "--chunk-size", "0"), "chunk_size 0")


def test_json_output_stays_json_with_non_finite_metadata(tmp_path: Path) -> None:
    store, src = tmp_path / "store", tmp_path / "f.txt"
    src.write_text("hi")
    assert (
        run_cli(
            store, "put", str(src), "r", "--meta", "loss=NaN", "--meta", "source=dir"
        ).returncode
        == 0
    )
    cas.open(store).save({"w": torch.ones(1)}, "py", metadata={"loss": float("inf")})

    def strict(text: str) -> Any:  # json.loads itself accepts bare NaN and Infinity
        def refuse(token: str) -> None:
            raise ValueError(f"not JSON: {token}")

        return json.loads(text, parse_constant=refuse)

    assert strict(run_cli(store, "ls", "--json").stdout)
    assert strict(run_cli(store, "show", "py", "--json").stdout)["meta"]["loss"] is None
    meta = strict(run_cli(store, "show", "r", "--json").stdout)["meta"]
    assert meta["loss"] == "NaN" and meta["source"] == "file"  # a user key cannot change the kind
    assert run_cli(store, "get", "r", str(tmp_path / "back.txt")).returncode == 0
    assert (tmp_path / "back.txt").read_text() == "hi"


def test_an_empty_directory_comes_back_as_an_empty_directory(tmp_path: Path) -> None:
    store, src = tmp_path / "store", tmp_path / "empty"
    src.mkdir()
    assert run_cli(store, "put", str(src), "e").returncode == 0
    assert run_cli(store, "get", "e", str(tmp_path / "back")).returncode == 0
    assert (tmp_path / "back").is_dir() and not any((tmp_path / "back").iterdir())


def test_a_binary_file_that_only_starts_like_a_pickle_is_stored_as_bytes(tmp_path: Path) -> None:
    store, src = tmp_path / "store", tmp_path / "src"
    src.mkdir()
    data = b"\x80\x04" + bytes(range(256)) * 64  # PROTO 4, then no valid pickle
    (src / "blob.dat").write_bytes(data)
    (src / "config.json").write_text("{}")
    assert run_cli(store, "put", str(src), "d").returncode == 0
    assert run_cli(store, "get", "d", str(tmp_path / "back")).returncode == 0
    assert (tmp_path / "back" / "blob.dat").read_bytes() == data
