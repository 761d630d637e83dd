"""An encrypted store writes a new chunk while its name is hashed, as a plain one does: the chunk
is sealed before its name is known (seal version 2), and its name is then bound by the digest
check every read makes rather than by the tag."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import cas
from cas.blobstore.local import LocalBlobStore
from cas.blobstore.sealed import MAGIC, NAMED_VERSION, SEAL_VERSION, SealedBlobStore, StoreKey
from cas.errors import IntegrityError
from tests.test_overlap import assert_writes_did_not_wait, slow_hash_and_recorded_writes

MiB = 1 << 20
PASSPHRASE = "correct horse battery staple"


def version_of(path: Path) -> int:
    head = path.read_bytes()[: len(MAGIC) + 1]
    assert head[: len(MAGIC)] == MAGIC
    return head[len(MAGIC)]


def chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "chunks").rglob("*") if p.is_file())


def test_an_encrypted_save_writes_each_new_chunk_while_its_name_is_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = slow_hash_and_recorded_writes(monkeypatch)
    opened = cas.open(tmp_path / "store", key=PASSPHRASE)
    repo = cas.Repository(opened.blobs, opened.config, workers=1)  # one chunk at a time
    gen = np.random.default_rng(1)
    state = {f"w{i}": gen.standard_normal(MiB // 2, dtype=np.float32) for i in range(8)}
    repo.save(state, "runs/a")

    assert_writes_did_not_wait(events)  # the sealed chunk was written while its hash ran
    back = cas.open(tmp_path / "store", key=PASSPHRASE).load("runs/a")
    assert all(np.array_equal(back[k], v) for k, v in state.items())
    versions = [version_of(p) for p in chunk_files(tmp_path / "store")]
    assert versions.count(NAMED_VERSION) >= 6  # the small ones are sealed under their names
    assert set(versions) <= {SEAL_VERSION, NAMED_VERSION}


def test_a_chunk_moved_under_another_chunks_name_fails_the_digest_check(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "s", key=PASSPHRASE)
    gen = np.random.default_rng(2)
    repo.save({"w": gen.standard_normal(MiB, dtype=np.float32)}, "runs/a")
    first = set(chunk_files(tmp_path / "s"))
    repo.save({"w": gen.standard_normal(MiB, dtype=np.float32)}, "runs/b")
    moved = [p for p in chunk_files(tmp_path / "s") if p not in first and p.stat().st_size > MiB]
    source = next(p for p in first if p.stat().st_size > MiB)
    assert moved and version_of(source) == NAMED_VERSION
    for target in moved:  # the tag still verifies there: only the content says it is wrong
        shutil.copyfile(source, target)
    with pytest.raises(IntegrityError):
        cas.open(tmp_path / "s", key=PASSPHRASE).load("runs/b")


def test_a_blob_sealed_before_its_name_is_refused_under_a_ref_name(tmp_path: Path) -> None:
    store = SealedBlobStore(LocalBlobStore(tmp_path / "s"), StoreKey.generate())
    chunk = "chunks/ab/ab" + "0" * 62
    assert store.put_if_absent_named(lambda: chunk, b"object bytes") is True
    assert store.get(chunk) == b"object bytes"
    store.put("refs/a", b"record")
    shutil.copyfile(tmp_path / "s" / store.stored_key(chunk), tmp_path / "s" / "refs" / "a")
    with pytest.raises(IntegrityError, match="not its own blob"):
        store.get("refs/a")


def test_a_blob_named_late_that_is_no_object_is_sealed_under_its_name(tmp_path: Path) -> None:
    store = SealedBlobStore(LocalBlobStore(tmp_path / "s"), StoreKey.generate())
    asked: list[str] = []

    def name() -> str:
        asked.append("refs/late")
        return "refs/late"

    assert store.put_if_absent_named(name, b"late record") is True
    assert asked == ["refs/late"]  # the name is still asked for once
    assert version_of(tmp_path / "s" / "refs" / "late") == SEAL_VERSION
    assert store.get("refs/late") == b"late record"
    assert store.put_if_absent_named(name, b"again") is False
