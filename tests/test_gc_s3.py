"""GC racing writers on a real S3 server: a paused writer, the check-then-delete window, a race."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import cas
from cas.blobstore.base import BlobStore, BytesLike, Version
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.digest import Digest
from cas.errors import LeaseExpired
from cas.names import RefName
from cas.objects.store import chunk_key
from cas.refs.keys import ref_key
from cas.repo.config import StoreConfig
from cas.retention.gc import GCResult, GCSettings
from tests.gc_workers import CHUNK, state
from tests.helpers import assert_bit_exact
from tests.retention_helpers import FrozenWriter, chunk_digests, reachable_chunks, tensor

pytestmark = pytest.mark.s3

NO_GRACE = GCSettings(grace=0, reflog_window=0)
ROOT = Path(__file__).resolve().parent.parent


def s3_repo(url: str, blobs: Callable[[BlobStore], BlobStore] | None = None, **extra: Any) -> Any:
    """The store at ``url`` with small chunks; ``blobs`` wraps its BlobStore (fault injection)."""
    config = StoreConfig(chunk_size=CHUNK, inline_max=64, extra=extra)
    repo = cas.open(url, config=config)
    if blobs is None:
        return repo
    return cas.Repository(blobs(repo.blobs), repo.config)


class StallRefWrite(FrozenWriter):
    """Freezes the writer at the first compare-and-swap of ``key`` until ``resume`` is set: a
    writer process frozen whole (its lease renewals too) between its last lease check and its
    ref update."""

    def __init__(self, inner: BlobStore, key: str) -> None:
        super().__init__(inner)
        self.key = key
        self.stalled = threading.Event()
        self.resume = threading.Event()

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        if key == self.key and not self.stalled.is_set():
            self.freeze()
            self.stalled.set()
            assert self.resume.wait(60)
            self.thaw()
        return self.inner.put_conditional(key, data, expected)


class HoldDelete(BlobStoreWrapper):
    """Holds GC between its check of ``key`` and the delete, until ``go`` is set."""

    def __init__(self, inner: BlobStore, key: str) -> None:
        super().__init__(inner)
        self.key = key
        self.reached = threading.Event()
        self.go = threading.Event()

    def delete(self, key: str) -> None:
        if key == self.key:
            self.reached.set()
            assert self.go.wait(60)
        self.inner.delete(key)


class SlowDelete(BlobStoreWrapper):
    """GC on a slow link: every delete waits a while after GC's last look at the object."""

    def delete(self, key: str) -> None:
        time.sleep(0.05)
        self.inner.delete(key)


class SignalTouch(BlobStoreWrapper):
    """Tells when a writer reused (touched) ``key``."""

    def __init__(self, inner: BlobStore, key: str) -> None:
        super().__init__(inner)
        self.key = key
        self.touched = threading.Event()

    def touch(self, key: str) -> None:
        self.inner.touch(key)
        if key == self.key:
            self.touched.set()


@pytest.mark.parametrize("ref", ["w/latest", "w/ckpt_1"], ids=["existing-ref", "new-ref"])
def test_a_writer_paused_past_its_lease_is_refused_and_loses_nothing_on_s3(
    s3_url: str, ref: str
) -> None:
    leases = {"duration": 3.0, "margin": 1.2}
    s3_repo(s3_url, leases=leases).save(state(1), "w/latest")
    stall: list[StallRefWrite] = []

    def wrap(blobs: BlobStore) -> BlobStore:
        stall.append(StallRefWrite(blobs, "refs/" + ref.replace("/", "%2F")))
        return stall[0]

    writer = s3_repo(s3_url, wrap)
    outcome: list[BaseException | str] = []

    def save() -> None:
        try:
            writer.save(state(2, 3), ref)
            outcome.append("reported saved")
        except LeaseExpired as e:
            outcome.append(e)

    thread = threading.Thread(target=save)
    thread.start()
    assert stall[0].stalled.wait(60)
    # Its lease expired, margin included, on every clock (S3 mtimes, GC's clock, count seconds).
    time.sleep(3.0 + 1.2 + 1.5)
    result = s3_repo(s3_url).plan_gc(NO_GRACE).execute()
    assert result.deleted_chunks >= 2  # what the paused writer had stored is gone
    stall[0].resume.set()
    thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseExpired), outcome
    repo = s3_repo(s3_url)
    assert repo.verify(level="full").ok
    assert_bit_exact(repo.load("w/latest"), state(1))
    assert [r.name for r in repo.refs()] == repo.ref_names() == ["w/latest"]
    assert not repo.blobs.has(ref_key(RefName("w/ckpt_1")))  # the refused writer took its fence
    repo.save(state(4), ref)  # a live writer replaces the fence and publishes
    assert_bit_exact(repo.load(ref), state(4))
    assert not repo.plan_gc(NO_GRACE).broken_refs


def unreferenced_old_chunk(url: str) -> tuple[dict[str, Any], Digest]:
    """A state of one chunk, stored at ``url`` and then forgotten, its chunk older than GC's
    cutoff: what a GC deletes unless a writer reuses it first."""
    reused = {"reused": tensor(7, CHUNK)}
    base = s3_repo(url)
    base.save(reused, "old")
    base.rm("old")
    time.sleep(1.1)  # older than GC's cutoff: S3 mtimes count whole seconds
    (digest,) = chunk_digests(base)
    return reused, Digest(digest)


def test_a_save_reusing_a_chunk_gc_is_about_to_delete_survives_on_s3(s3_url: str) -> None:
    reused, digest = unreferenced_old_chunk(s3_url)
    key = chunk_key(digest)
    holds: list[HoldDelete] = []
    touches: list[SignalTouch] = []

    def hold(blobs: BlobStore) -> BlobStore:
        holds.append(HoldDelete(blobs, key))
        return holds[0]

    def signal(blobs: BlobStore) -> BlobStore:
        touches.append(SignalTouch(blobs, key))
        return touches[0]

    gc_repo = s3_repo(s3_url, hold)
    writer = s3_repo(s3_url, signal)
    results: list[GCResult] = []
    gc = threading.Thread(target=lambda: results.append(gc_repo.plan_gc(NO_GRACE).execute()))
    gc.start()
    assert holds[0].reached.wait(60)  # GC checked the chunk: old and unreachable
    saved: list[object] = []
    save = threading.Thread(target=lambda: saved.append(writer.save(reused, "new")))
    save.start()
    assert touches[0].touched.wait(60)  # the save reused it...
    holds[0].go.set()  # ...and then GC deletes it
    gc.join(60)
    save.join(60)
    assert results[0].deleted_chunks == 1 and len(saved) == 1
    repo = s3_repo(s3_url)
    assert_bit_exact(repo.load("new"), reused)
    assert repo.verify(level="full").ok


def test_saves_from_two_processes_racing_forget_and_gc_lose_nothing_on_s3(
    s3_url: str, tmp_path: Path
) -> None:
    s3_repo(s3_url, leases={"duration": 30.0, "margin": 2.0})
    repo = s3_repo(s3_url, SlowDelete)
    outs = [tmp_path / f"w{w}.json" for w in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.gc_workers", s3_url, str(w), "20", str(outs[w])],
            cwd=ROOT,
        )
        for w in range(2)
    ]
    results = []
    while any(p.poll() is None for p in procs):
        results.append(repo.plan_gc(NO_GRACE).execute())
    assert [p.wait() for p in procs] == [0, 0]
    outcomes = [json.loads(out.read_text()) for out in outs]
    assert [p for o in outcomes for p in o["problems"]] == []
    saves = {ref: seeds for o in outcomes for ref, seeds in o["saved"]}
    assert len(saves) > 20 and sum(r.deleted_chunks for r in results) > 20
    assert sum(o["refused"] for o in outcomes) <= len(saves) // 10  # refusals stay rare
    names = {r.name for r in repo.refs()}
    assert names and names <= saves.keys()
    for name in names:
        assert_bit_exact(repo.load(name), state(*saves[name]))
    assert repo.verify(level="full").ok
    repo.plan_gc(NO_GRACE).execute()
    assert chunk_digests(repo) == reachable_chunks(repo)
