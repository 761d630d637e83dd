"""Invariant 10: an object found corrupt is quarantined and never reused; the next write of the
same bytes heals every checkpoint naming it, and another store can heal it too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import cas
from cas.blobstore import BlobStore, LocalBlobStore
from cas.blobstore.cache import CachingBlobStore
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.digest import Digest
from cas.model.manifest import ChunkRef, FileEntry, Manifest
from cas.objects.envelope import HEADER_SIZE
from cas.objects.store import chunk_key
from cas.repo.config import StoreConfig, read_config
from cas.repo.opening import CACHED_PREFIXES, verify_cached_object
from cas.repo.repository import Repository
from cas.retention.gc import GCSettings
from tests.helpers import assert_bit_exact, local_root, run_cli, small_chunk_repo

CHUNK = 4096


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 64, generator=generator),
        "b": torch.randn(700, generator=generator),
    }


def chunk_path(repo: cas.Repository, digest: Digest) -> Path:
    return local_root(repo) / chunk_key(digest)


def rot(path: Path, offset: int = -1) -> None:
    """Flip one bit of a stored file in place, as bit rot does."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def first_chunk(repo: cas.Repository, ref: str, tensor: int = 0) -> Digest:
    return repo.manifest(ref).tensors[tensor].chunks[0].digest


def test_a_rotted_chunk_is_quarantined_on_load_and_healed_by_the_next_save(
    tmp_path: Path,
) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK)
    state = weights()
    repo.save(state, "runs/r1/ckpt_step00000100")
    digest = first_chunk(repo, "runs/r1/ckpt_step00000100")
    rot(chunk_path(repo, digest))

    with pytest.raises(cas.IntegrityError, match="moved aside"):
        repo.load("runs/r1/ckpt_step00000100")
    assert not repo.objects.has_chunk(digest)
    [record] = repo.objects.quarantined()
    assert (record.kind, record.digest, record.operation) == ("chunks", digest, "read")
    assert "hash" in record.detail and record.found_at > 0
    assert (local_root(repo) / record.key).is_file()
    with pytest.raises(cas.IntegrityError, match="quarantined"):
        repo.load("runs/r1/ckpt_step00000100")  # corrupt, not merely missing

    repo.save(state, "runs/r1/ckpt_step00000200")

    assert_bit_exact(repo.load("runs/r1/ckpt_step00000100"), state)
    assert_bit_exact(repo.load("runs/r1/ckpt_step00000200"), state)
    assert repo.verify(level="full").ok


def test_a_reused_chunk_whose_header_declares_another_size_is_rewritten(tmp_path: Path) -> None:
    # A cheap check on reuse: the decoded size in the stored header must be the chunk's size.
    repo = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK)
    state = weights()
    repo.save(state, "a")
    path = chunk_path(repo, first_chunk(repo, "a"))
    data = bytearray(path.read_bytes())
    data[8:16] = (CHUNK + 1).to_bytes(8, "little")  # the header's decoded size
    path.write_bytes(bytes(data))

    repo.save(state, "b")

    assert int.from_bytes(path.read_bytes()[8:16], "little") == CHUNK
    assert_bit_exact(repo.load("a"), state)
    assert_bit_exact(repo.load("b"), state)


def test_a_reused_raw_chunk_cut_short_is_rewritten(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK, codec="raw")
    state = weights()
    repo.save(state, "a")
    path = chunk_path(repo, first_chunk(repo, "a"))
    path.write_bytes(path.read_bytes()[: HEADER_SIZE + 100])

    repo.save(state, "b")

    assert path.stat().st_size == HEADER_SIZE + CHUNK
    assert_bit_exact(repo.load("a"), state)


def test_a_corrupt_manifest_is_quarantined_and_reads_as_corrupt_afterwards(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK)
    repo.save(weights(), "r")
    target = repo.resolve("r")
    rot(local_root(repo) / "manifests" / target[:2] / target)

    with pytest.raises(cas.IntegrityError, match="moved aside"):
        repo.load("r")
    with pytest.raises(cas.IntegrityError, match="quarantined"):
        repo.show("r")
    [record] = repo.objects.quarantined()
    assert (record.kind, record.digest) == ("manifests", target)
    report = repo.verify()
    assert [(p.kind, p.refs) for p in report.problems] == [("corrupt-manifest", ("r",))]
    assert report.quarantined == 1


def delta_repo(root: Path) -> cas.Repository:
    extra = {"delta": {"max_depth": 8}}
    config = StoreConfig(chunk_size=16 << 10, inline_max=256, codec="xor-delta", extra=extra)
    return cas.open(root, config=config)


def delta_pair(repo: cas.Repository) -> tuple[dict[str, Any], dict[str, Any], Digest, Digest]:
    """Two checkpoints, the second stored as a delta on the first: (states, delta, its base)."""
    first = {"w": torch.arange(8192, dtype=torch.float32)}
    second = {"w": first["w"] + 0.25}
    repo.save(first, "a")
    repo.save(second, "b", parent="a")
    delta = first_chunk(repo, "b")
    base = repo.objects.chunk_base(delta)
    assert base is not None and base == first_chunk(repo, "a")
    return first, second, delta, base


def test_a_bad_delta_base_is_quarantined_and_the_good_delta_built_on_it_is_not(
    tmp_path: Path,
) -> None:
    repo = delta_repo(tmp_path / "store")
    first, second, delta, base = delta_pair(repo)
    rot(chunk_path(repo, base))

    with pytest.raises(cas.IntegrityError):
        repo.load("b")  # the delta hashes wrong: its base is what is bad

    assert [r.digest for r in repo.objects.quarantined()] == [base]
    assert repo.objects.has_chunk(delta)
    repo.save(first, "a2")  # heals the base, and with it the delta
    assert_bit_exact(repo.load("b"), second)
    assert_bit_exact(repo.load("a"), first)


def test_a_bad_delta_on_a_good_base_is_the_one_quarantined(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "store")
    first, second, delta, base = delta_pair(repo)
    rot(chunk_path(repo, delta))

    with pytest.raises(cas.IntegrityError, match="moved aside"):
        repo.load("b")

    assert [r.digest for r in repo.objects.quarantined()] == [delta]
    assert repo.objects.has_chunk(base)
    assert_bit_exact(repo.load("a"), first)
    repo.save(second, "b2")
    assert_bit_exact(repo.load("b"), second)


def test_a_read_only_store_refuses_the_bytes_without_moving_them(tmp_path: Path) -> None:
    writer = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK)
    writer.save(weights(), "r")
    path = chunk_path(writer, first_chunk(writer, "r"))
    rot(path)
    rotted = path.read_bytes()

    reader = cas.open(tmp_path / "store", readonly=True)
    with pytest.raises(cas.IntegrityError):
        reader.load("r")
    assert not reader.verify(level="full").ok

    assert path.read_bytes() == rotted
    assert not (local_root(writer) / "quarantine").exists()


class _HealsDuringQuarantine(BlobStoreWrapper):
    """A store where another writer re-stores a good copy of ``key`` just as the reader that
    found it corrupt starts to set it aside."""

    def __init__(self, inner: BlobStore, key: str, good: bytes) -> None:
        super().__init__(inner)
        self.key, self.good = key, good

    def put(self, key: str, data: Any) -> None:
        if key.startswith("quarantine/") and self.good:
            self.inner.put(self.key, self.good)
            self.good = b""
        self.inner.put(key, data)


def test_quarantine_never_removes_a_good_copy_a_writer_stored_meanwhile(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK)
    state = weights()
    repo.save(state, "r")
    digest = first_chunk(repo, "r")
    good = chunk_path(repo, digest).read_bytes()
    rot(chunk_path(repo, digest))
    config = read_config(repo.blobs)
    assert config is not None
    racing = Repository(_HealsDuringQuarantine(repo.blobs, chunk_key(digest), good), config)

    with pytest.raises(cas.IntegrityError):
        racing.load("r")

    assert chunk_path(repo, digest).read_bytes() == good
    assert racing.objects.quarantined() == []
    assert_bit_exact(repo.load("r"), state)


def test_a_corrupt_remote_chunk_behind_a_cache_is_quarantined_on_the_remote(
    tmp_path: Path,
) -> None:
    remote = small_chunk_repo(tmp_path / "remote", chunk_size=CHUNK)
    state = weights()
    remote.save(state, "r")
    digest = first_chunk(remote, "r")
    rot(chunk_path(remote, digest))
    cache = LocalBlobStore(tmp_path / "cache")
    blobs = CachingBlobStore(
        cache, remote.blobs, prefixes=CACHED_PREFIXES, verify=verify_cached_object
    )
    config = read_config(blobs)
    assert config is not None
    through_cache = Repository(blobs, config)

    with pytest.raises(cas.IntegrityError):
        through_cache.load("r")

    assert not remote.objects.has_chunk(digest) and not cache.has(chunk_key(digest))
    assert [r.digest for r in remote.objects.quarantined()] == [digest]
    through_cache.save(state, "r2")
    assert_bit_exact(remote.load("r"), state)


def test_verify_full_reports_a_tensor_entry_whose_size_disagrees_with_its_chunk(
    tmp_path: Path,
) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK)
    repo.save({"w": torch.randn(CHUNK // 4)}, "honest")
    real = repo.manifest("honest")
    digest = real.tensors[0].chunks[0].digest
    # A manifest that claims one 4 KiB chunk holds a 1 GiB tensor (the largest chunk size a
    # manifest may declare).
    big = 1 << 30
    tensor = real.tensors[0]
    lying = Manifest(
        kind="state",
        tensors=(
            type(tensor)(
                "torch", "float32", (big // 4,), big, (ChunkRef(digest, big),), None, None
            ),
        ),
        tree=real.tree,
    )
    repo.commit(lying, "lying")
    repo.cp("lying", "lying-copy")

    report = repo.verify(level="full")

    [problem] = report.problems
    assert problem.kind == "size-mismatch" and problem.digest == digest
    assert set(problem.refs) == {"lying", "lying-copy"}
    assert f"holds {CHUNK} bytes" in problem.detail and str(big) in problem.detail
    assert repo.verify(["honest"], level="full").ok
    assert repo.objects.quarantined() == []  # the chunk is sound; the manifest is not
    existence = repo.verify(level="existence")  # the header's declared size shows it too
    assert [p.kind for p in existence.problems] == ["size-mismatch"]


def test_verify_full_reports_a_file_entry_whose_size_disagrees_with_its_chunk(
    tmp_path: Path,
) -> None:
    # A 5-byte file on a 100-byte chunk, which `get` would write as 100 bytes.
    repo = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK)
    source = tmp_path / "data.bin"
    source.write_bytes(bytes(range(100)))
    repo.put_path(source, "files/honest")
    [entry] = repo.manifest("files/honest").files.values()
    digest = entry.chunks[0].digest
    lying = Manifest(
        kind="files",
        tensors=(),
        files={"data.bin": FileEntry(5, "raw", (ChunkRef(digest, 5),))},
    )
    repo.commit(lying, "files/lying")

    report = repo.verify(level="full")

    assert [(p.kind, p.ref, p.digest) for p in report.problems] == [
        ("size-mismatch", "files/lying", digest)
    ]
    result = run_cli(tmp_path / "store", "verify", "--full", "--json")
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    assert doc["broken_refs"] == ["files/lying"]


def _rotted_store_and_peer(tmp_path: Path) -> tuple[cas.Repository, dict[str, Any], Digest]:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK)
    peer = small_chunk_repo(tmp_path / "peer", chunk_size=CHUNK)
    state = weights()
    repo.save(state, "runs/r1/ckpt_step00000100")
    repo.cp("runs/r1/ckpt_step00000100", "gates/best")
    repo.save(weights(1), "runs/r1/ckpt_step00000200")
    repo.push(peer, ["runs/r1/ckpt_step00000100"])
    digest = first_chunk(repo, "runs/r1/ckpt_step00000100")
    rot(chunk_path(repo, digest))
    return repo, state, digest


def test_verify_repair_from_heals_a_rotted_chunk_from_another_store(tmp_path: Path) -> None:
    repo, state, digest = _rotted_store_and_peer(tmp_path)

    result = run_cli(
        tmp_path / "store", "verify", "--full", "--repair-from", str(tmp_path / "peer")
    )

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"healed chunk {digest} (copied from" in result.stdout
    assert "repaired: 1 objects healed, 0 refs still broken" in result.stdout
    assert f"PROBLEM gates/best: corrupt-chunk: {digest}" in result.stderr
    assert_bit_exact(repo.load("runs/r1/ckpt_step00000100"), state)
    assert_bit_exact(repo.load("gates/best"), state)
    assert repo.verify(level="full").ok
    stats = json.loads(run_cli(tmp_path / "store", "stats", "--json").stdout)
    assert stats["quarantined_objects"] == 1  # the bad copy stays for inspection


def test_verify_repair_from_a_store_that_lacks_the_object_says_which_refs_stay_broken(
    tmp_path: Path,
) -> None:
    _rotted_store_and_peer(tmp_path)
    empty = tmp_path / "empty"
    cas.open(empty)

    result = run_cli(tmp_path / "store", "verify", "--full", "--repair-from", str(empty), "--json")

    assert result.returncode == 1 and "Traceback" not in result.stderr
    doc = json.loads(result.stdout)
    assert doc["healed"] == [] and len(doc["unhealed"]) == 1
    assert doc["still_broken"] == ["gates/best", "runs/r1/ckpt_step00000100"]
    assert doc["quarantined"] == 1


def test_gc_leaves_the_quarantine_alone_and_counts_none_of_it_as_chunks(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store", chunk_size=CHUNK)
    repo.save(weights(), "r")
    digest = first_chunk(repo, "r")
    rot(chunk_path(repo, digest))
    with pytest.raises(cas.IntegrityError):
        repo.load("r")
    repo.rm("r")
    chunks_left = len(list(repo.blobs.list("chunks/")))

    plan = repo.plan_gc(GCSettings(grace=0.0, reflog_window=0.0))
    plan.execute()

    assert plan.stored_chunks == chunks_left
    assert len(list(repo.blobs.list("quarantine/"))) == 2
    assert repo.store_stats().quarantined_objects == 1
