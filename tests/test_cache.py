"""A local cache in front of S3, and archiving: push, drop locally, free what no local ref needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cas
from cas.blobstore import BlobStore, LocalBlobStore, MemoryBlobStore
from cas.blobstore.cache import CachingBlobStore
from cas.blobstore.s3 import S3BlobStore
from cas.digest import digest_of
from cas.errors import IntegrityError
from cas.objects.store import chunk_key
from cas.repo.config import StoreConfig, read_config
from cas.repo.opening import CACHED_PREFIXES, verify_cached_object
from cas.repo.repository import Repository
from cas.testing.faulty import FaultyBlobStore
from tests.helpers import assert_bit_exact, chunk_files, small_chunk_repo

CONFIG = StoreConfig(chunk_size=64 << 10, inline_max=256)


def model_state(seed: int, layers: int = 6) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(128, 256, generator=generator) for i in range(layers)}


def caching(local: BlobStore, remote: BlobStore) -> CachingBlobStore:
    """``remote`` behind a cache in ``local``, as ``cas.open(url, cache=...)`` builds it."""
    return CachingBlobStore(local, remote, prefixes=CACHED_PREFIXES, verify=verify_cached_object)


def cached_repo(s3_url: str, cache_dir: Path) -> tuple[Repository, FaultyBlobStore]:
    """A repository over S3 through a cache, with the remote's calls counted."""
    counted = FaultyBlobStore(S3BlobStore.from_url(s3_url))  # rate 0: it only counts
    blobs = caching(LocalBlobStore(cache_dir), counted)
    config = read_config(blobs)
    assert config is not None
    return Repository(blobs, config), counted


@pytest.mark.s3
def test_a_second_read_through_the_cache_does_not_touch_the_remote(
    tmp_path: Path, s3_url: str
) -> None:
    state = model_state(1)
    cas.open(s3_url, config=CONFIG).save(state, "runs/r1/latest")
    repo, remote = cached_repo(s3_url, tmp_path / "cache")

    assert_bit_exact(repo.load("runs/r1/latest"), state)
    first_gets = remote.calls["get"]
    remote.calls.clear()
    assert_bit_exact(repo.load("runs/r1/latest"), state)

    assert first_gets >= 6 * 2  # every chunk (and the manifest) came from S3 once
    assert remote.calls["get"] == 0
    assert remote.calls["get_versioned"] == 1  # only the ref is asked for: refs are never cached


@pytest.mark.s3
def test_a_corrupt_remote_chunk_is_refused_and_never_cached(tmp_path: Path, s3_url: str) -> None:
    writer = cas.open(s3_url, config=CONFIG)
    digest = writer.save(model_state(2, layers=1), "a")
    victim = sorted(writer.manifest(digest).chunk_digests())[0]
    blob = bytearray(writer.blobs.get(chunk_key(victim)))
    blob[-1] ^= 0x01
    writer.blobs.put(chunk_key(victim), bytes(blob))
    repo, _ = cached_repo(s3_url, tmp_path / "cache")

    with pytest.raises(IntegrityError, match=victim):
        repo.load("a")
    assert isinstance(repo.blobs, CachingBlobStore)
    assert not repo.blobs.cached(chunk_key(victim))


@pytest.mark.s3
def test_saves_through_the_cache_land_on_the_remote_before_the_ref(
    tmp_path: Path, s3_url: str
) -> None:
    cas.open(s3_url, config=CONFIG)
    through_cache = cas.open(s3_url, cache=tmp_path / "cache")
    state = model_state(3)

    through_cache.save(state, "runs/r1/latest")

    assert_bit_exact(cas.open(s3_url).load("runs/r1/latest"), state)  # no cache: all on S3
    cached_chunks = set(LocalBlobStore(tmp_path / "cache").list("chunks/"))
    assert cached_chunks == set(through_cache.blobs.list("chunks/"))


def test_a_create_only_put_caches_only_what_it_created(tmp_path: Path) -> None:
    remote = MemoryBlobStore()
    blobs = caching(LocalBlobStore(tmp_path / "cache"), remote)
    ours, theirs = chunk_key(digest_of(b"ours")), chunk_key(digest_of(b"theirs"))
    assert blobs.put_if_absent(ours, (b"our ", b"encoding")) is True
    assert blobs.cached(ours) and blobs.local.get(ours) == b"our encoding"
    # Another writer's encoding is on the remote: the cache must not hold ours instead.
    remote.put(theirs, b"their encoding")
    assert blobs.put_if_absent(theirs, (b"our encoding",)) is False
    assert not blobs.cached(theirs)
    assert remote.get(theirs) == b"their encoding"


def test_archive_frees_only_chunks_no_remaining_local_ref_needs(tmp_path: Path) -> None:
    local = small_chunk_repo(tmp_path / "local")
    remote = small_chunk_repo(tmp_path / "archive")
    old = model_state(4)
    new = {**old, "layer0": old["layer0"] + 1}  # shares five of six tensors with ``old``
    local.save(old, "runs/r1/ckpt_step00000100")
    local.save(new, "runs/r1/ckpt_step00000200")
    before = chunk_files(local)
    only_old = {chunk_key(d) for d in local.manifest("runs/r1/ckpt_step00000100").chunk_digests()}
    only_old -= {chunk_key(d) for d in local.manifest("runs/r1/ckpt_step00000200").chunk_digests()}

    report = local.archive(remote, ["runs/r1/ckpt_step00000100"])

    assert report.removed_refs == ["runs/r1/ckpt_step00000100"]
    assert report.freed_chunks == len(only_old) == 2  # layer0 is 128 KiB: two 64 KiB chunks
    assert chunk_files(local) == before - only_old
    assert [r.name for r in local.refs()] == ["runs/r1/ckpt_step00000200"]
    assert_bit_exact(local.load("runs/r1/ckpt_step00000200"), new)
    local.pull(remote, ["runs/r1/ckpt_step00000100"])
    assert_bit_exact(local.load("runs/r1/ckpt_step00000100"), old)


def test_archive_of_a_checkpoint_another_local_ref_names_frees_nothing(tmp_path: Path) -> None:
    local = small_chunk_repo(tmp_path / "local")
    local.save(model_state(5), "runs/r1/ckpt_step00000100")
    local.cp("runs/r1/ckpt_step00000100", "gates/best")
    before = chunk_files(local)

    report = local.archive(small_chunk_repo(tmp_path / "archive"), ["runs/r1"])

    assert report.removed_refs == ["runs/r1/ckpt_step00000100"]
    assert report.freed_chunks == 0 and chunk_files(local) == before
    assert_bit_exact(local.load("gates/best"), model_state(5))


def test_a_reused_chunk_reports_the_base_the_remote_copy_needs_not_the_cached_one() -> None:
    # This machine cached X standalone; the remote's GC swept X and another machine stored it
    # again as a delta against B. Reusing X through the cache must record B.
    import numpy as np

    from cas.codecs import EncodeHints, codec_by_name
    from cas.objects.store import ObjectStore

    remote, local = MemoryBlobStore(), MemoryBlobStore()
    through_cache, elsewhere = (
        ObjectStore(caching(local, remote)),
        ObjectStore(remote),
    )
    b = np.random.default_rng(0).standard_normal(4096).astype(np.float32).tobytes()
    x = bytearray(b)
    x[100] ^= 1
    dx, db = digest_of(bytes(x)), digest_of(b)
    through_cache.put_chunk(bytes(x), codec_by_name("zstd"))
    remote.delete(chunk_key(dx))
    elsewhere.put_chunk(b, codec_by_name("zstd"))
    hints = EncodeHints(elem_size=4, base=b, base_digest=db)
    elsewhere.put_chunk(bytes(x), codec_by_name("xor-delta"), hints)
    reused = through_cache.put_chunk(bytes(x), codec_by_name("zstd"))
    assert not reused.new and reused.base == db


@pytest.mark.parametrize("victim", ["chunk", "its base"])
def test_a_damaged_cached_chunk_is_read_again_from_the_remote(tmp_path: Path, victim: str) -> None:
    writer = small_chunk_repo(tmp_path / "remote", codec="auto", extra={"delta": {"max_depth": 8}})
    first = {"w": torch.randn(8192)}
    second = {"w": first["w"].clone()}
    second["w"][::97] += 1.0
    writer.save(first, "a")
    writer.save(second, "b", parent="a")
    entry = writer.manifest("b").tensors[0]
    assert entry.base_digests()  # stored as a delta
    cache = LocalBlobStore(tmp_path / "cache")
    repo = Repository(
        caching(cache, writer.blobs),
        writer.config,
    )
    assert_bit_exact(repo.load("b"), second)  # fills the cache
    digest = entry.chunks[0].digest if victim == "chunk" else sorted(entry.base_digests())[0]
    key = chunk_key(digest)
    damaged = bytearray(cache.get(key))
    damaged[-1] ^= 0x01
    cache.put(key, bytes(damaged))
    assert_bit_exact(repo.load("b"), second)
    assert cache.get(key) == writer.blobs.get(key)  # the cached copy was replaced
