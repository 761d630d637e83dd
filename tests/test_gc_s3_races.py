"""GC against pushes and crashes on a real S3 server: racing pushers, a GC or a push killed
together with the server, and a corrupt object healed by the next write of the same data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import cas
from cas.blobstore.base import BlobStore, BytesLike
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.digest import Digest
from cas.errors import IntegrityError, LeaseExpired, NotFound
from cas.objects.store import chunk_key
from cas.repo.config import StoreConfig
from cas.retention.policy import RetentionPolicy, Rule
from cas.testing.seaweed import SeaweedServer
from tests.gc_workers import CHUNK, state
from tests.helpers import assert_bit_exact
from tests.retention_helpers import chunk_digests, reachable_chunks, tensor
from tests.s3_race_workers import KEEP_LAST, SlowDelete
from tests.test_gc_s3 import NO_GRACE, ROOT, s3_repo, unreferenced_old_chunk

pytestmark = pytest.mark.s3

WORKERS = [sys.executable, "-m", "tests.s3_race_workers"]


def local_repo(path: Path) -> Any:
    """A local store with the same small chunks as the S3 stores here."""
    return cas.open(path, config=StoreConfig(chunk_size=CHUNK, inline_max=64), fsync=False)


def cas_command(store: Path, *args: str) -> list[str]:
    """The ``cas`` command line for ``store``."""
    return [sys.executable, "-m", "cas", "--store", str(store), "-q", *args]


def stored_chunks(server: SeaweedServer, bucket: str, prefix: str) -> int:
    """How many chunk objects are under ``prefix``, counted by listing with boto3."""
    pages = server.client().get_paginator("list_objects_v2")
    return sum(
        page.get("KeyCount", 0)
        for page in pages.paginate(Bucket=bucket, Prefix=f"{prefix}/chunks/")
    )


def sweep_state(server: SeaweedServer, bucket: str, prefix: str) -> str:
    """``sweeping`` or ``idle`` as GC last announced, or ``none``."""
    client = server.client()
    try:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/state/gc-sweep")["Body"].read()
    except client.exceptions.NoSuchKey:
        return "none"
    return str(json.loads(body)["state"])


def wait_for(condition: Any, timeout: float, what: str) -> None:
    """Poll ``condition()`` every 20 ms until it is true; fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def kill_both(process: subprocess.Popen[bytes], server: SeaweedServer) -> None:
    """SIGKILL a client process and the server together, as a power cut would."""
    os.kill(process.pid, signal.SIGKILL)
    server.kill()
    process.wait(30)


def test_pushes_from_three_processes_racing_forget_and_gc_lose_nothing_on_s3(
    s3_url: str, tmp_path: Path
) -> None:
    s3_repo(s3_url, leases={"duration": 30.0, "margin": 2.0})
    # Half a second between GC's last look at a chunk and its delete: a wide window for a push
    # to reuse the chunk in.
    repo = s3_repo(s3_url, lambda blobs: SlowDelete(blobs, 0.5))
    policy = RetentionPolicy(rules=(Rule("w*/ckpt_*", keep_last=KEEP_LAST),))
    outs = [tmp_path / f"w{w}.json" for w in range(3)]
    procs = [
        subprocess.Popen(
            [*WORKERS, "push", str(tmp_path / f"local{w}"), s3_url, str(w), "15", str(outs[w])],
            cwd=ROOT,
        )
        for w in range(3)
    ]
    forgotten = 0
    results = []
    while any(p.poll() is None for p in procs):
        forgotten += len(repo.forget(policy).removed)
        results.append(repo.plan_gc(NO_GRACE).execute())
    assert [p.wait() for p in procs] == [0, 0, 0]
    outcomes = [json.loads(out.read_text()) for out in outs]
    assert [p for o in outcomes for p in o["problems"]] == []
    pushes = {ref: seeds for o in outcomes for ref, seeds in o["pushed"]}
    assert len(pushes) > 15 and forgotten > 6 and sum(r.deleted_chunks for r in results) > 20
    # A refusal is a push a deletion overlapped and took from: rare, even with slow deletes.
    assert sum(o["refused"] for o in outcomes) <= len(pushes) // 5
    names = {r.name for r in repo.refs()}
    for outcome in outcomes:  # each pusher's newest pushes are all still named
        assert {ref for ref, _ in outcome["pushed"][-KEEP_LAST:]} <= names
    assert names <= pushes.keys()
    for name in names:
        assert_bit_exact(repo.load(name), state(*pushes[name]))
    assert repo.verify(level="full").ok
    repo.plan_gc(NO_GRACE).execute()
    assert chunk_digests(repo) == reachable_chunks(repo)


class Rendezvous:
    """Orders a GC and a push: GC stops before deleting one chunk, the push stops when it reads
    its ref for the compare-and-swap, and the test lets the delete land in between."""

    def __init__(self) -> None:
        self.gc_checked = threading.Event()
        self.delete = threading.Event()
        self.deleted = threading.Event()
        self.push_committing = threading.Event()
        self.commit = threading.Event()


class GCSide(BlobStoreWrapper):
    def __init__(self, inner: BlobStore, key: str, meet: Rendezvous) -> None:
        super().__init__(inner)
        self.key, self.meet = key, meet

    def delete(self, key: str) -> None:
        if key == self.key:
            self.meet.gc_checked.set()  # stat said: old and unreachable
            assert self.meet.delete.wait(60)
            self.inner.delete(key)
            self.meet.deleted.set()
            return
        self.inner.delete(key)


class PushSide(BlobStoreWrapper):
    def __init__(self, inner: BlobStore, meet: Rendezvous) -> None:
        super().__init__(inner)
        self.meet = meet

    def put_transient(self, key: str, data: BytesLike) -> None:
        self.inner.put_transient(key, data)
        declares = key.startswith("leases/") and b'"commits": ["new"]' in bytes(data)
        if declares and not self.meet.push_committing.is_set():
            # The lease now declares the ref: every chunk was found, touched and checked, and
            # the ref is read for the compare-and-swap next.
            self.meet.push_committing.set()
            assert self.meet.commit.wait(60)


def test_a_push_reusing_a_chunk_gc_deletes_before_its_commit_is_refused_not_lost(
    s3_url: str, tmp_path: Path
) -> None:
    reused, digest = unreferenced_old_chunk(s3_url)
    meet = Rendezvous()
    gc_repo = s3_repo(s3_url, lambda blobs: GCSide(blobs, chunk_key(digest), meet))
    remote = s3_repo(s3_url, lambda blobs: PushSide(blobs, meet))
    local = local_repo(tmp_path / "local")
    local.save(reused, "new")
    gc = threading.Thread(target=lambda: gc_repo.plan_gc(NO_GRACE).execute())
    gc.start()
    assert meet.gc_checked.wait(60)
    outcome: list[object] = []

    def push() -> None:
        try:
            outcome.append(local.push(remote, ["new"]))
        except LeaseExpired as e:
            outcome.append(e)

    pusher = threading.Thread(target=push)
    pusher.start()
    assert meet.push_committing.wait(60)  # the push reused the chunk GC checked...
    meet.delete.set()  # ...GC deletes it...
    assert meet.deleted.wait(60)
    meet.commit.set()  # ...and then the push tries to publish
    pusher.join(60)
    gc.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseExpired), outcome
    assert "collected" in str(outcome[0])
    repo = s3_repo(s3_url)
    assert [r.name for r in repo.refs()] == []  # refused: no ref names the deleted chunk
    local.push(repo, ["new"])  # pushed again, it stores the chunk anew
    assert_bit_exact(repo.load("new"), reused)
    assert repo.verify(level="full").ok


def test_gc_killed_with_the_server_mid_sweep_loses_no_save_and_blocks_nothing_after(
    tmp_path: Path, private_seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = private_seaweed
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)  # the ports survive restarts
    url = "s3://crash/gc-killed"
    repo = s3_repo(url)
    kept = {f"runs/r{i}/latest": (i, 20 + i) for i in range(4)}
    for name, seeds in kept.items():
        repo.save(state(*seeds), name)
    for i in range(3):
        repo.save({"garbage": tensor(100 + i, 200 * CHUNK)}, f"scratch/{i}")
        repo.rm(f"scratch/{i}")
    reachable = len(reachable_chunks(repo))
    before = stored_chunks(server, "crash", "gc-killed")
    assert before >= reachable + 600
    time.sleep(1.1)  # older than GC's cutoff: S3 mtimes count whole seconds
    # A second per delete: the one batch of 600 lasts ~10 s, and it is killed in its first.
    gc = subprocess.Popen([*WORKERS, "gc", url, "1.0"], cwd=ROOT)
    wait_for(
        lambda: stored_chunks(server, "crash", "gc-killed") <= before - 64,
        60,
        "GC to delete its first chunks",
    )
    assert sweep_state(server, "crash", "gc-killed") == "sweeping"
    kill_both(gc, server)
    server.start()
    assert stored_chunks(server, "crash", "gc-killed") > reachable + 64  # killed mid-sweep

    repo = s3_repo(url)
    for name, seeds in kept.items():
        assert_bit_exact(repo.load(name), state(*seeds))
    began = time.monotonic()
    repo.save(state(7, 8), "runs/r9/latest")  # the dead run's sweep window holds no commit
    result = repo.plan_gc(NO_GRACE).execute()  # nor does its maintenance lock hold GC
    assert time.monotonic() - began < 60
    assert result.deleted_chunks > 64
    assert_bit_exact(repo.load("runs/r9/latest"), state(7, 8))
    for name, seeds in kept.items():
        assert_bit_exact(repo.load(name), state(*seeds))
    assert repo.verify(level="full").ok
    assert chunk_digests(repo) == reachable_chunks(repo)


def test_a_push_killed_with_the_server_mid_way_loses_nothing_and_its_rerun_completes(
    tmp_path: Path, private_seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = private_seaweed
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    url = "s3://crash/push-killed"
    local = local_repo(tmp_path / "local")
    remote = s3_repo(url)
    earlier = {f"runs/r{i}/latest": (i, 40 + i) for i in range(3)}
    for name, seeds in earlier.items():
        local.save(state(*seeds), name)
        local.push(remote, [name])  # reported pushes
    big = {"big": tensor(77, 800 * CHUNK), **state(1, 41)}  # reuses what is already there
    local.save(big, "runs/big/latest")
    before = stored_chunks(server, "crash", "push-killed")
    push = subprocess.Popen(
        cas_command(tmp_path / "local", "push", "--to", url, "-j", "1", "runs/big/latest"),
        cwd=ROOT,
    )
    wait_for(
        lambda: stored_chunks(server, "crash", "push-killed") >= before + 150,
        60,
        "the push to store its first chunks",
    )
    kill_both(push, server)
    assert push.returncode == -signal.SIGKILL
    server.start()

    remote = s3_repo(url)
    with pytest.raises(NotFound):
        remote.resolve("runs/big/latest")
    for name, seeds in earlier.items():
        assert_bit_exact(remote.load(name), state(*seeds))
    began = time.monotonic()
    swept = remote.plan_gc(NO_GRACE).execute()  # the dead push's lease protects nothing now
    assert time.monotonic() - began < 60 and swept.deleted_chunks >= 150
    rerun = subprocess.run(
        cas_command(tmp_path / "local", "push", "--to", url, "runs/big/latest"),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert remote.plan_gc(NO_GRACE).execute().deleted_chunks == 0
    assert_bit_exact(remote.load("runs/big/latest"), big)
    for name, seeds in earlier.items():
        assert_bit_exact(remote.load(name), state(*seeds))
    assert remote.verify(level="full").ok


def flip_payload_byte(server: SeaweedServer, url: str, digest: Digest) -> None:
    """Flip one byte in the middle of a stored chunk's payload, straight through boto3."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = server.client()
    key = f"{prefix}/{chunk_key(digest)}"
    blob = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    blob[len(blob) - 100] ^= 0x10
    client.put_object(Bucket=bucket, Key=key, Body=bytes(blob))


def test_a_chunk_corrupted_on_s3_is_healed_by_a_push_and_by_a_save_of_the_same_data(
    s3_url: str, tmp_path: Path, seaweed: SeaweedServer
) -> None:
    local = local_repo(tmp_path / "good")
    remote = s3_repo(s3_url)
    first = {"w": tensor(5, 3 * CHUNK)}
    local.save(first, "runs/a/latest")
    local.push(remote, ["runs/a/latest"])
    victim, *_ = sorted(remote.manifest(remote.resolve("runs/a/latest")).chunk_digests())

    # A push of the same data under a new ref from a good store, before any reader saw the
    # damage: the one read that checks what the push reuses returns a chunk this small whole.
    flip_payload_byte(seaweed, s3_url, victim)
    local.save(first, "runs/b/latest")
    assert local.push(remote, ["runs/b/latest"]).chunks_rewritten == 1
    for name in ("runs/a/latest", "runs/b/latest"):
        assert_bit_exact(remote.load(name), first)

    # Found by a reader first: verify names every ref it breaks and sets it aside, and a
    # re-push copies it again.
    flip_payload_byte(seaweed, s3_url, victim)
    report = remote.verify(level="full")
    assert [(p.kind, p.refs) for p in report.problems] == [
        ("corrupt-chunk", ("runs/a/latest", "runs/b/latest"))
    ]
    with pytest.raises(IntegrityError, match="quarantined"):
        remote.load("runs/b/latest")
    assert local.push(remote, ["runs/b/latest"]).chunks_moved == 1
    for name in ("runs/a/latest", "runs/b/latest"):
        assert_bit_exact(remote.load(name), first)

    # A direct save of the same tensors, before any reader saw the damage: a chunk this small
    # is verified in full by the one read that finds it stored, and written again.
    flip_payload_byte(seaweed, s3_url, victim)
    remote.save(first, "runs/c/latest")
    for name in ("runs/a/latest", "runs/b/latest", "runs/c/latest"):
        assert_bit_exact(remote.load(name), first)
    assert remote.verify(level="full").ok
    assert len(remote.objects.quarantined()) == 1  # only the copy the first verify set aside
