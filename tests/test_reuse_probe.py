"""A re-save hashes reused chunks where they lie; only what it writes is read privately first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cas
import cas.blobstore.local as local_module
import cas.objects.overlap as overlap_module
import cas.objects.store as store_module
from cas.blobstore.direct import O_DIRECT
from cas.digest import Digest, digest_of
from cas.objects.staging import StagingPool
from tests.helpers import ref_chunk_paths
from tests.test_direct_io import in_page_cache


def one_worker(path: Path) -> cas.Repository:
    """The store at ``path`` with one chunk worker, so puts run in order and the odds each one
    reads are those every put before it left."""
    opened = cas.open(path)
    return cas.Repository(opened.blobs, opened.config, workers=1)


def tensors(count: int, seed: int) -> dict[str, Any]:
    """Tensors of 2 MiB, one chunk each; torch's, which the door reads where they lie."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(1 << 19, generator=gen) for i in range(count)}


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the private copies the chunk door makes (leases of the staging pool)."""
    made: list[int] = []
    real = StagingPool.lease

    @contextlib.contextmanager
    def counting(self: StagingPool, nbytes: int) -> Iterator[Any]:
        made.append(nbytes)
        with real(self, nbytes) as staged:
            yield staged

    monkeypatch.setattr(StagingPool, "lease", counting)
    return made


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the buffers the chunk door hashes, itself or while it writes them
    (``cas.objects.overlap``)."""
    sizes: list[int] = []
    real = digest_of  # the store module calls it by this name; patched there below

    def counting(data: bytes | bytearray | memoryview) -> Digest:
        sizes.append(memoryview(data).nbytes)
        return real(data)

    monkeypatch.setattr(store_module, "digest_of", counting)
    monkeypatch.setattr(overlap_module, "digest_of", counting)
    return sizes


def test_a_resave_of_unchanged_tensors_copies_only_the_changed_one(
    tmp_path: Path, copies: list[int]
) -> None:
    state = tensors(8, 1)
    one_worker(tmp_path / "store").save(state, "runs/a")
    assert len(copies) == 8  # every chunk written was read privately first
    copies.clear()
    changed = dict(state, w3=state["w3"] + 1)
    repo = one_worker(tmp_path / "store")  # a new process, as a cron job or a resumed run
    repo.save(changed, "runs/b")
    # The changed chunk was read privately to be written; the seven reused ones were hashed in
    # place (three hits before the miss keep the odds above even after it).
    assert copies == [2 << 20]
    back = repo.load("runs/b")
    assert all(bool((back[k] == v).all()) for k, v in changed.items())


def test_in_one_process_a_resave_after_a_first_save_soon_probes_again(
    tmp_path: Path, copies: list[int]
) -> None:
    state = tensors(16, 3)
    repo = one_worker(tmp_path / "store")
    repo.save(state, "runs/a")  # sixteen new chunks: the odds of a reuse fall
    copies.clear()
    repo.save(state, "runs/b")
    # The first reuses, found after a private reading, raise the odds back within a few puts;
    # the rest are hashed in place.
    assert 0 < len(copies) <= 6


def test_a_first_save_stops_probing_once_chunks_turn_out_new(
    tmp_path: Path, hashed: list[int]
) -> None:
    one_worker(tmp_path / "store").save(tensors(16, 2), "runs/a")
    big = [n for n in hashed if n == 2 << 20]
    # Each of the 16 new chunks is hashed once where it is written; only the first six puts
    # probed in place, until the odds of a reuse fell from even below a quarter (with more chunk
    # workers, one put per worker can start before the first miss).
    assert len(big) == 16 + 6


@pytest.mark.skipif(not O_DIRECT, reason="this platform has no O_DIRECT")
def test_new_chunks_skip_the_page_cache_and_are_made_durable_with_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New chunks of a first save and of a re-save (among reused ones) go past the page cache,
    and the save's sync still fsyncs their directories."""
    synced: list[Path] = []
    real_fsync_dir = local_module._fsync_dir

    def recording(directory: Path) -> None:
        synced.append(directory)
        real_fsync_dir(directory)

    monkeypatch.setattr(local_module, "_fsync_dir", recording)
    state = tensors(8, 5)
    one_worker(tmp_path / "store").save(state, "runs/a")
    changed = dict(state, w3=state["w3"] + 1)
    repo = one_worker(tmp_path / "store")
    synced.clear()
    repo.save(changed, "runs/b")

    first = set(ref_chunk_paths(repo, "runs/a"))
    (new,) = set(ref_chunk_paths(repo, "runs/b")) - first
    assert not any(in_page_cache(path, path.stat().st_size) for path in [*first, new])
    assert new.parent in synced
    back = repo.load("runs/b")
    assert all(bool((back[k] == v).all()) for k, v in changed.items())
