"""Invariant 1 watched call by call: a save (and a push, at its destination) makes its chunks
durable, then its manifest, then moves its ref.

A crash test only sees the order when the kill lands in the one gap a bug opens; here the order
itself is recorded. ``RecordingBlobStore`` writes down every write and ``sync`` a save sends to
the store, on every backend; on a local store the system calls underneath are recorded too (each
``fsync`` with the file or directory it made durable, each rename and link), so a manifest whose
file or directory entry is not fsynced before the ref's rename is seen, whatever the layers above
believe they asked for.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cas
from cas.blobstore import LocalBlobStore
from cas.objects.keys import ObjectKind, object_key
from cas.repo.config import StoreConfig
from cas.testing.recording import Call, RecordingBlobStore

REF = "runs/r/latest"
WRITES = ("put", "put_if_absent", "touch", "found")


def _state(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    frozen = torch.randn(12_000, generator=generator)  # unchanged between saves: reused
    return {"frozen": frozen, "head": torch.full((6_000,), float(step))}


def _open(where: str, tmp_path: Path, request: pytest.FixtureRequest) -> cas.Repository:
    config = StoreConfig(chunk_size=8192, inline_max=64)
    url = request.getfixturevalue("s3_url") if where == "s3" else str(tmp_path / "store")
    opened = cas.open(url, config=config)
    return cas.Repository(RecordingBlobStore(opened.blobs), opened.config)


def _assert_save_order(calls: list[Call], repo: cas.Repository) -> None:
    """Chunks written or reused, then a sync, then the manifest, then a sync, then the ref."""
    ref_writes = [i for i, c in enumerate(calls) if c.key.startswith("refs/") and c.op != "found"]
    assert len(ref_writes) == 1, f"one ref write per save, got {calls}"
    ref_at = ref_writes[0]
    target = repo.manifest(REF)
    manifest = object_key(ObjectKind.MANIFEST, repo.resolve(REF))
    manifest_at = max(i for i, c in enumerate(calls) if c.key == manifest and c.op in WRITES)
    syncs = [i for i, c in enumerate(calls) if c.op == "sync"]
    assert any(manifest_at < s < ref_at for s in syncs), (
        f"the ref moved before the manifest was made durable: {calls[manifest_at : ref_at + 1]}"
    )
    chunk_keys = {object_key(ObjectKind.CHUNK, d) for d in target.chunk_digests()}
    last_chunk = max(i for i, c in enumerate(calls) if c.key in chunk_keys and c.op in WRITES)
    assert any(last_chunk < s < manifest_at for s in syncs), (
        f"the manifest was written before the chunks were made durable: "
        f"{calls[last_chunk : manifest_at + 1]}"
    )


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_save_syncs_its_chunks_then_its_manifest_before_its_ref_moves(
    tmp_path: Path, request: pytest.FixtureRequest, where: str
) -> None:
    repo = _open(where, tmp_path, request)
    recorder = repo.blobs
    assert isinstance(recorder, RecordingBlobStore)
    for step in range(2):  # a first save, then one reusing the frozen tensor's chunks
        start = len(recorder.history())
        repo.save(_state(step), REF)
        _assert_save_order(recorder.history()[start:], repo)
    repo.close()


class _Syscalls:
    """Every fsync (with the path it made durable), rename and link, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str, str]] = []
        real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

        def fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
            real_fsync(fd)

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            real_replace(src, dst, **kw)
            self.events.append(("rename", str(src), str(dst)))

        def link(src: Any, dst: Any, **kw: Any) -> None:
            real_link(src, dst, **kw)
            self.events.append(("rename", str(src), str(dst)))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "link", link)

    def durable_at(self, path: Path, before: int) -> None:
        """Assert ``path``'s bytes and its directory entry were fsynced before event ``before``."""
        made = [
            i for i, e in enumerate(self.events[:before]) if e[0] == "rename" and e[2] == str(path)
        ]
        assert made, f"{path} was not written before event {before}"
        at, temp = made[-1], self.events[made[-1]][1]
        assert ("fsync", temp, "") in self.events[:at], f"{path}: its bytes were never fsynced"
        entry = ("fsync", str(path.parent), "")
        assert entry in self.events[at:before], (
            f"{path}: its directory was not fsynced between its rename and event {before}"
        )


@pytest.fixture
def syscalls(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Syscalls]:
    yield _Syscalls(monkeypatch)


def test_on_disk_the_manifest_and_chunks_are_fsynced_before_the_refs_rename(
    tmp_path: Path, syscalls: _Syscalls
) -> None:
    root = (tmp_path / "store").resolve()
    repo = cas.open(root, config=StoreConfig(chunk_size=8192, inline_max=64))
    assert isinstance(repo.blobs, LocalBlobStore)  # it writes through the os calls recorded
    for step in range(2):
        syscalls.events.clear()
        repo.save(_state(step), REF)
        renames = [
            (i, e) for i, e in enumerate(syscalls.events) if e[0] == "rename" and "/refs/" in e[2]
        ]
        assert len(renames) == 1, syscalls.events
        ref_at, (_, _, ref_path) = renames[0]
        syscalls.durable_at(root / object_key(ObjectKind.MANIFEST, repo.resolve(REF)), ref_at)
        for digest in repo.manifest(REF).chunk_digests():
            chunk = root / object_key(ObjectKind.CHUNK, digest)
            if any(e[2] == str(chunk) for e in syscalls.events[:ref_at]):  # new in this save
                syscalls.durable_at(chunk, ref_at)
        assert ("fsync", str(Path(ref_path).parent), "") in syscalls.events[ref_at:]
    repo.close()


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_push_makes_its_chunks_then_its_manifest_durable_before_the_remote_ref_moves(
    tmp_path: Path, request: pytest.FixtureRequest, where: str
) -> None:
    source = cas.open(tmp_path / "source", config=StoreConfig(chunk_size=8192, inline_max=64))
    remote = _open(where, tmp_path, request)
    recorder = remote.blobs
    assert isinstance(recorder, RecordingBlobStore)
    for step in range(2):
        source.save(_state(step), REF)
        start = len(recorder.history())
        source.push(remote, [REF])
        _assert_save_order(recorder.history()[start:], remote)
    source.close()
    remote.close()
