"""A new chunk's file is written while its name (its hash) is computed, and named once both end."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cas
import cas.objects.overlap as overlap
from cas.blobstore.local import TMP_DIR, LocalBlobStore
from cas.codecs import codec_by_name
from cas.digest import digest_of
from cas.errors import BackendError
from cas.objects.envelope import HEADER_SIZE
from cas.objects.store import ObjectStore, chunk_key
from tests.helpers import ref_chunk_paths

MiB = 1 << 20
SLOW_HASH = 0.25
"""Seconds the stand-in hash takes: a write of 2 MiB and its fsync that does not wait for it ends
sooner, even on a loaded machine (at 0.02 s the suite's other workers made it flaky)."""
RAW = codec_by_name("raw")


def likely_new(root: Path) -> ObjectStore:
    """An object store on ``root`` whose odds say the next put is new (as in a first save)."""
    objects = ObjectStore(LocalBlobStore(root))
    objects._reuse.share = 0.0
    return objects


def blob(seed: int, size: int = 2 * MiB) -> Any:
    return np.random.default_rng(seed).integers(0, 255, size, dtype=np.uint8)


def temp_files(root: Path) -> list[Path]:
    return list((root / TMP_DIR).rglob("*.tmp"))


def slow_hash_and_recorded_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    """From now on each chunk hash takes ``SLOW_HASH`` longer, and the list returned receives,
    in order, when each hash started and when each temp file of over 1 MiB was written."""
    events: list[tuple[str, float]] = []
    lock = threading.Lock()
    real_hash, real_write = overlap._hash, LocalBlobStore._write_temp

    def hash_(view: memoryview) -> Any:
        with lock:
            events.append(("hash started", time.monotonic()))
        time.sleep(SLOW_HASH)  # a slow hash: the write must not wait for it to begin
        return real_hash(view)

    def write(self: LocalBlobStore, *parts: Any, fsync: bool = True) -> Path:
        path = real_write(self, *parts, fsync=fsync)
        if sum(memoryview(p).nbytes for p in parts) > MiB:
            with lock:
                events.append(("written", time.monotonic()))
        return path

    monkeypatch.setattr(overlap, "_hash", hash_)
    monkeypatch.setattr(LocalBlobStore, "_write_temp", write)
    return events


def assert_writes_did_not_wait(events: list[tuple[str, float]]) -> None:
    """Every chunk's write ended while the hash it raced was still running (after the first
    put, probed in place, as the odds start even). Chunks go one at a time, so each hash's
    write is the event right after its start, or right before it when the write ended before
    the hashing thread got to run (a first hash starts that thread)."""
    kinds = [kind for kind, _ in events]
    assert kinds.count("hash started") >= 6
    paired: set[int] = set()
    for index, (kind, started) in enumerate(events):
        if kind != "hash started":
            continue
        after = index + 1 < len(events) and kinds[index + 1] == "written"
        partner = index + 1 if after else index - 1
        assert partner >= 0 and kinds[partner] == "written" and partner not in paired, events
        paired.add(partner)
        assert abs(events[partner][1] - started) < SLOW_HASH, events


def test_a_first_save_hashes_each_new_chunk_while_its_file_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = slow_hash_and_recorded_writes(monkeypatch)
    opened = cas.open(tmp_path / "store")
    repo = cas.Repository(opened.blobs, opened.config, workers=1)  # one chunk at a time
    gen = np.random.default_rng(1)
    state = {f"w{i}": gen.standard_normal(MiB // 2, dtype=np.float32) for i in range(8)}
    repo.save(state, "runs/a")

    assert_writes_did_not_wait(events)
    back = repo.load("runs/a")
    assert all(np.array_equal(back[k], v) for k, v in state.items())
    for path in ref_chunk_paths(repo, "runs/a"):  # each file is named by its bytes' hash
        assert path.name == digest_of(path.read_bytes()[HEADER_SIZE:])
    assert temp_files(tmp_path / "store") == []


def test_a_chunk_found_stored_after_its_write_is_reused_and_its_copy_dropped(
    tmp_path: Path,
) -> None:
    data = blob(2)
    first = likely_new(tmp_path).put_chunk(data, RAW)
    path = tmp_path / chunk_key(first.digest)
    before = path.read_bytes()
    again = likely_new(tmp_path).put_chunk(data, RAW)
    assert first.new and not again.new and again.digest == first.digest
    assert path.read_bytes() == before and temp_files(tmp_path) == []


def test_a_damaged_chunk_under_the_name_is_written_again(tmp_path: Path) -> None:
    data = blob(3)
    digest = likely_new(tmp_path).put_chunk(data, RAW).digest
    path = tmp_path / chunk_key(digest)
    path.write_bytes(b"not a chunk header")
    result = likely_new(tmp_path).put_chunk(data, RAW)
    assert result.new and result.digest == digest
    assert bytes(ObjectStore(LocalBlobStore(tmp_path)).get_chunk(digest)) == data.tobytes()
    assert temp_files(tmp_path) == []


def test_a_failed_write_waits_for_the_hash_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ended: list[float] = []
    real_hash = overlap._hash

    def hash_(view: memoryview) -> Any:
        time.sleep(0.05)
        try:
            return real_hash(view)
        finally:
            ended.append(time.monotonic())

    def full(self: LocalBlobStore, *parts: Any, fsync: bool = True) -> Path:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(overlap, "_hash", hash_)
    monkeypatch.setattr(LocalBlobStore, "_write_temp", full)
    with pytest.raises(BackendError, match="No space left"):
        likely_new(tmp_path).put_chunk(blob(4), RAW)
    raised = time.monotonic()
    # The hash read the staging buffer until it ended; the buffer went back only after that.
    assert len(ended) == 1 and ended[0] <= raised
    assert not any(p.is_file() for p in tmp_path.rglob("*") if "chunks" in p.parts)


def test_a_re_save_writes_each_changed_chunk_while_hashing_it_and_no_stored_chunk_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-save's handle probes each chunk where it lies. A changed chunk (the probe missed)
    goes to disk at once while it is hashed again; four of them in a row do not turn the odds,
    so the stored chunks after them are not copied and written again."""
    stored = [blob(10 + i) for i in range(12)]
    first_save = ObjectStore(LocalBlobStore(tmp_path))
    assert all(first_save.put_chunk(data, RAW).new for data in stored)
    events = slow_hash_and_recorded_writes(monkeypatch)
    changed = [blob(100 + i) for i in range(4)]

    re_save = ObjectStore(LocalBlobStore(tmp_path))  # a new handle, as each save opens one
    results = [re_save.put_chunk(data, RAW) for data in stored[:6] + changed + stored[6:]]

    assert [r.new for r in results] == [False] * 6 + [True] * 4 + [False] * 6
    assert [kind for kind, _ in events] == ["hash started", "written"] * 4, events
    for (_, started), (_, written) in zip(events[::2], events[1::2], strict=True):
        assert written - started < SLOW_HASH, events  # the write did not wait for the hash
    assert re_save._reuse.likely()
    for data, result in zip(changed, results[6:10], strict=True):
        assert bytes(re_save.get_chunk(result.digest)) == data.tobytes()
    assert temp_files(tmp_path) == []
