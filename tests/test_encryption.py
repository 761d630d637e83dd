"""Encrypted stores: nothing readable without the key, dedup kept, every alteration caught; and
handles that cannot delete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import numpy as np
import pytest

import cas
from cas.blobstore import LocalBlobStore
from cas.blobstore.appendonly import AppendOnly
from cas.blobstore.base import BytesLike, Payload
from cas.blobstore.sealed import SealedBlobStore, StoreKey
from cas.errors import IntegrityError
from cas.repo.keys import KeyRequired, WrongKey
from cas.testing.conformance import BlobStoreConformance

PATTERN = b"CAS-PLAINTEXT-PATTERN-0123456789"
PASSPHRASE = "correct horse battery staple"


class TestSealedBlobStore(BlobStoreConformance):
    def make_store(self) -> SealedBlobStore:
        return SealedBlobStore(LocalBlobStore(self.tmp_path / "store"), StoreKey.generate())


@pytest.fixture(autouse=True)
def no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CAS_KEY", "CAS_KEY_FILE", "CAS_KEY_COMMAND", "CAS_APPEND_ONLY"):
        monkeypatch.delenv(name, raising=False)


def state(seed: int = 0) -> dict[str, np.ndarray]:
    """A state whose tensors hold a byte pattern a reader of the storage could search for."""
    marked = np.frombuffer(PATTERN * 4096, dtype=np.uint8).copy()
    return {"marked": marked, "w": np.random.default_rng(seed).standard_normal(50_000).astype("f4")}


def stored_files(root: Path) -> Iterator[Path]:
    return (p for p in root.rglob("*") if p.is_file() and "tmp" not in p.relative_to(root).parts)


def test_no_plaintext_or_digest_of_a_saved_tensor_appears_in_a_local_store(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "s", key=PASSPHRASE)
    saved = state()
    repo.save(saved, "runs/r1/ckpt", metadata={"note": PATTERN.decode()})
    names = {str(p.relative_to(tmp_path / "s")) for p in stored_files(tmp_path / "s")}
    digests = {c.digest for c in repo.manifest("runs/r1/ckpt").chunk_refs()}
    assert digests and not any(d in name for d in digests for name in names)
    for path in stored_files(tmp_path / "s"):
        assert PATTERN not in path.read_bytes(), path
        assert PATTERN[:16] not in path.read_bytes(), path
    assert np.array_equal(repo.load("runs/r1/ckpt")["marked"], saved["marked"])


def test_no_plaintext_appears_in_any_object_of_an_encrypted_s3_store(s3_url: str) -> None:
    repo = cas.open(s3_url, key=PASSPHRASE)
    repo.save(state(), "runs/r1/ckpt", metadata={"note": PATTERN.decode()})
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    assert any("/chunks/" in k for k in keys)
    for key in keys:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert PATTERN not in body and PATTERN[:16] not in body, key
    assert np.array_equal(cas.open(s3_url, key=PASSPHRASE).load("runs/r1/ckpt")["w"], state()["w"])


def test_the_same_state_saved_twice_adds_no_chunk(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "s", key=PASSPHRASE)
    repo.save(state(), "runs/r1/a")
    repo.save(state(), "runs/r1/b")
    assert repo.last_write.new_chunks == 0
    assert repo.last_write.reused_chunks > 0


def test_a_push_between_stores_sharing_a_key_copies_only_missing_objects(tmp_path: Path) -> None:
    a = cas.open(tmp_path / "a", key=PASSPHRASE)
    b = cas.open(tmp_path / "b", key="another passphrase", key_from=a)
    a.save(state(0), "runs/r1/one")
    first = a.push(b, ["runs/r1/one"])
    assert first.chunks_moved > 0
    a.save({**state(0), "w": state(1)["w"]}, "runs/r1/two")  # the marked tensor is unchanged
    second = a.push(b, ["runs/r1/two"])
    assert 0 < second.chunks_moved < first.chunks_moved
    names_a = {p.name for p in (tmp_path / "a" / "chunks").rglob("*") if p.is_file()}
    names_b = {p.name for p in (tmp_path / "b" / "chunks").rglob("*") if p.is_file()}
    assert names_a == names_b  # one key, one name per content: the stores dedup together
    assert np.array_equal(b.load("runs/r1/two")["marked"], state()["marked"])


def test_a_push_between_stores_sharing_a_key_copies_objects_as_they_are_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = cas.open(tmp_path / "a", key=PASSPHRASE)
    b = cas.open(tmp_path / "b", key="another passphrase", key_from=a)
    a.save(state(0), "runs/r1/one")
    a.push(b, ["runs/r1/one"])
    a.save({**state(0), "w": state(1)["w"]}, "runs/r1/two")
    sealed: list[str] = []
    seal = SealedBlobStore.seal

    def counted_seal(
        self: SealedBlobStore, key: str, data: Payload, into: memoryview | None = None
    ) -> list[BytesLike]:
        sealed.append(key)
        return seal(self, key, data, into)

    monkeypatch.setattr(SealedBlobStore, "seal", counted_seal)
    second = a.push(b, ["runs/r1/two"])
    assert second.chunks_moved == 1  # only the changed tensor's chunk was missing
    assert not [key for key in sealed if key.startswith(("chunks/", "manifests/"))]
    for kind in ("chunks", "manifests"):
        files_a = {p.relative_to(tmp_path / "a"): p for p in (tmp_path / "a" / kind).rglob("*")}
        for name, path in files_a.items():
            if path.is_file():
                assert (tmp_path / "b" / name).read_bytes() == path.read_bytes(), name
    assert np.array_equal(b.load("runs/r1/two")["w"], state(1)["w"])


def test_an_encrypted_load_decrypts_chunk_files_into_the_tensors_without_whole_blob_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = cas.open(tmp_path / "s", key=PASSPHRASE)
    saved = {"big": np.arange(3 << 20, dtype="f4"), **state()}  # several 4 MiB chunks
    repo.save(saved, "runs/r1/ckpt")
    assert repo.blobs.reads_in_place
    whole: list[str] = []
    get = SealedBlobStore.get

    def counted_get(self: SealedBlobStore, key: str) -> bytes:
        whole.append(key)
        return get(self, key)

    monkeypatch.setattr(SealedBlobStore, "get", counted_get)
    loaded = repo.load("runs/r1/ckpt")
    assert all(np.array_equal(loaded[name], value) for name, value in saved.items())
    assert not [key for key in whole if key.startswith("chunks/")]


def test_a_sealed_file_is_read_into_the_buffers_and_decrypted_there_whatever_its_size(
    tmp_path: Path,
) -> None:
    store = SealedBlobStore(LocalBlobStore(tmp_path / "s"), StoreKey.generate())
    data = np.random.default_rng(3).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    store.put("chunks/ab/" + "ab" * 32, data)
    key = "chunks/ab/" + "ab" * 32

    def read(*sizes: int) -> tuple[int | None, bytes]:
        outs = [memoryview(bytearray(n)) for n in sizes]
        got = store.read_into_buffers(key, 0, outs)
        return got, b"".join(bytes(out) for out in outs)

    got, back = read(40_000, 60_000)  # exactly the plaintext: ciphertext lands in the buffers
    assert (got, back) == (len(data), data)
    got, back = read(70_000, 50_000)  # room to spare: the tag falls inside a buffer
    assert got == len(data) and back[: len(data)] == data
    assert read(50_000, 49_999)[0] is None  # too small: the tag covers the whole blob
    path = next(p for p in (tmp_path / "s" / "chunks").rglob("*") if p.is_file())
    sealed = bytearray(path.read_bytes())
    sealed[-1] ^= 0x01  # the tag
    path.write_bytes(bytes(sealed))
    with pytest.raises(IntegrityError):
        read(40_000, 60_000)


def test_background_writes_of_an_encrypted_store_stay_sealed_and_go_past_the_page_cache(
    tmp_path: Path,
) -> None:
    repo = cas.open(tmp_path / "s", key=PASSPHRASE)
    writer = repo.for_background_writes()
    sealed = writer.blobs
    assert isinstance(sealed, SealedBlobStore) and sealed is not repo.blobs
    assert isinstance(sealed.inner, LocalBlobStore) and sealed.inner.direct_io
    marked = np.frombuffer(PATTERN * (1 << 16), dtype=np.uint8).copy()  # 2 MiB: written direct
    writer.save({"marked": marked}, "runs/r1/ckpt")
    for path in stored_files(tmp_path / "s"):
        assert PATTERN not in path.read_bytes(), path
    assert np.array_equal(repo.load("runs/r1/ckpt")["marked"], marked)


def test_a_push_to_a_plain_store_reseals_only_what_is_missing(tmp_path: Path) -> None:
    a = cas.open(tmp_path / "a", key=PASSPHRASE)
    plain = cas.open(tmp_path / "plain")
    a.save(state(0), "runs/r1/one")
    assert a.push(plain, ["runs/r1/one"]).chunks_moved > 0
    assert a.push(plain, ["runs/r1/one"]).chunks_moved == 0
    assert np.array_equal(plain.load("runs/r1/one")["w"], state(0)["w"])
    back = cas.open(tmp_path / "c", key="third")
    assert plain.push(back, ["runs/r1/one"]).chunks_moved > 0
    assert np.array_equal(back.load("runs/r1/one")["marked"], state()["marked"])


@pytest.mark.parametrize("kind", ["chunks", "manifests", "refs"])
def test_a_flipped_byte_in_any_sealed_object_is_an_integrity_error(
    tmp_path: Path, kind: str
) -> None:
    repo = cas.open(tmp_path / "s", key=PASSPHRASE)
    repo.save(state(), "runs/r1/ckpt")
    repo.close()
    for path in (tmp_path / "s" / kind).rglob("*"):
        if path.is_file():
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
    reopened = cas.open(tmp_path / "s", key=PASSPHRASE)
    with pytest.raises(IntegrityError):
        reopened.load("runs/r1/ckpt")


def test_an_object_moved_to_another_name_fails_its_tag(tmp_path: Path) -> None:
    key = StoreKey.generate()
    store = SealedBlobStore(LocalBlobStore(tmp_path / "s"), key)
    store.put("refs/a", b"record a")
    store.put("refs/b", b"record b")
    (tmp_path / "s" / "refs" / "b").write_bytes((tmp_path / "s" / "refs" / "a").read_bytes())
    with pytest.raises(IntegrityError):
        store.get("refs/b")


def test_a_wrong_or_missing_key_fails_in_one_line(tmp_path: Path) -> None:
    cas.open(tmp_path / "s", key=PASSPHRASE).save(state(), "runs/r1/ckpt")
    with pytest.raises(WrongKey):
        cas.open(tmp_path / "s", key="wrong")
    with pytest.raises(KeyRequired):
        cas.open(tmp_path / "s")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAS_KEY")}
    for extra in ({"CAS_KEY": "wrong"}, {}):
        out = subprocess.run(
            [sys.executable, "-m", "cas", "--store", str(tmp_path / "s"), "ls"],
            capture_output=True, text=True, env={**env, **extra}, timeout=120,
        )  # fmt: skip
        assert out.returncode != 0
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "Traceback" not in out.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(tmp_path / "s"), "ls"],
        capture_output=True, text=True, env={**env, "CAS_KEY": PASSPHRASE}, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0 and "runs/r1/ckpt" in ok.stdout


def test_keys_are_added_changed_and_removed_and_an_old_passphrase_is_refused(
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "s")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAS_KEY")}

    def run(*args: str, passphrase: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cas", "--store", store, *args],
            capture_output=True, text=True, env={**env, "CAS_KEY": passphrase}, timeout=120,
        )  # fmt: skip

    assert run("init", "--encrypt", passphrase="first").returncode == 0
    cas.open(store, key="first").save(state(), "runs/r1/ckpt")
    (tmp_path / "second").write_text("second\n")
    (tmp_path / "third").write_text("third\n")
    assert (
        run("key", "add", "--new-key-file", str(tmp_path / "second"), passphrase="first").returncode
        == 0
    )
    listed = run("key", "list", "--json", passphrase="second")
    assert listed.returncode == 0 and listed.stdout.count('"id"') == 2
    changed = run("key", "passwd", "--new-key-file", str(tmp_path / "third"), passphrase="first")
    assert changed.returncode == 0, changed.stderr
    with pytest.raises(WrongKey):
        cas.open(store, key="first")
    assert np.array_equal(cas.open(store, key="third").load("runs/r1/ckpt")["w"], state()["w"])
    import json

    slots = json.loads(run("key", "list", "--json", passphrase="third").stdout)
    second = next(s["id"] for s in slots if not s["current"])
    assert run("key", "remove", second, passphrase="third").returncode == 0
    with pytest.raises(WrongKey):
        cas.open(store, key="second")
    last = run(
        "key",
        "remove",
        slots[0]["id"] if slots[0]["current"] else slots[1]["id"],
        passphrase="third",
    )
    assert last.returncode != 0  # the key in use (and the last) stays


def test_a_passphrase_from_a_command_opens_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cas.open(tmp_path / "s", key=PASSPHRASE).save(state(), "runs/r1/ckpt")
    monkeypatch.setenv("CAS_KEY_COMMAND", f"echo '{PASSPHRASE}'")
    assert cas.open(tmp_path / "s").refs("runs/")


def test_an_append_only_handle_saves_and_moves_refs_but_refuses_every_delete(
    tmp_path: Path,
) -> None:
    cas.open(tmp_path / "s").save(state(0), "runs/r1/old")
    writer = cas.open(tmp_path / "s", append_only=True)
    writer.save(state(1), "runs/r1/new")
    writer.cp("runs/r1/new", "runs/r1/latest")
    writer.cp("runs/r1/old", "runs/r1/latest", overwrite=True)  # a ref move is no delete
    before = sorted(p.name for p in (tmp_path / "s").rglob("*") if p.is_file())
    with pytest.raises(AppendOnly):
        writer.rm("runs/r1/old")
    from cas.retention.policy import RetentionPolicy, Rule

    with pytest.raises(AppendOnly):
        writer.forget(RetentionPolicy(rules=(Rule(select="runs/r1/*", keep_last=1),)))
    with pytest.raises(AppendOnly):
        writer.plan_gc().execute()
    assert writer.refs("runs/r1/old")
    after = sorted(p.name for p in (tmp_path / "s").rglob("*") if p.is_file())
    assert set(before) <= set(after)
    maintenance = cas.open(tmp_path / "s")
    maintenance.rm("runs/r1/old")  # the maintenance host's handle may


def test_a_store_created_append_only_opens_every_handle_so(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(tmp_path / "s"), "init", "--append-only"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    repo = cas.open(tmp_path / "s")
    repo.save(state(), "runs/r1/ckpt")
    assert repo.append_only
    refused = subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(tmp_path / "s"), "rm", "runs/r1/ckpt"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode != 0 and "append-only" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_gc_verify_retention_the_manager_and_cas_urls_work_on_an_encrypted_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec
    import torch

    from cas.retention.gc import GCSettings
    from cas.retention.policy import RetentionPolicy, Rule
    from cas.training.manager import CheckpointManager

    monkeypatch.setenv("CAS_KEY", PASSPHRASE)
    repo = cas.open(tmp_path / "s")
    model = torch.nn.Linear(64, 64)
    with CheckpointManager(
        repo, run="runs/r1", every_n_steps=1, signals=False, async_save=False
    ) as mgr:
        for step in range(1, 4):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.step_end(step, {"model": model.state_dict()}, metrics={"loss": 1.0 / step})
    with CheckpointManager(repo, run="runs/r1", signals=False, async_save=False) as again:
        restored = again.restore("auto")
    assert restored.step == 3
    assert torch.equal(restored.state["model"]["weight"], model.weight)
    repo.forget(RetentionPolicy(rules=(Rule(select="runs/r1/phase*/ckpt_*", keep_last=1),)))
    freed = repo.plan_gc(GCSettings(grace=0, reflog_window=0)).execute()
    assert freed.deleted_chunks > 0
    assert repo.verify(level="full").ok
    with fsspec.open("cas://runs/r1/latest/manifest.json", "rb", store=str(tmp_path / "s")) as f:
        assert f.read()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_while_a_sealed_buffer_lock_is_held_still_saves(tmp_path: Path) -> None:
    from cas.blobstore import sealed as sealed_module

    repo = cas.open(tmp_path / "s", key=PASSPHRASE)
    with sealed_module.BUFFERS._lock:  # another thread mid-lease at the fork
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a child stuck on the parent's lock dies instead of hanging
            data = np.arange(1 << 19, dtype="f4")  # 2 MiB: sealed through the pool
            repo.save({"w": data}, "runs/child")
            os._exit(0 if np.array_equal(repo.load("runs/child")["w"], data) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
