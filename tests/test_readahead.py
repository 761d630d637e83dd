"""Read-ahead of a load from a cold disk (``cas.objects.readahead``): the chunk files the readers
will want are advised to the kernel ahead of them, those in the page cache are left alone, and
the advice never runs more than its window ahead of the readers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import cas
from cas.blobstore import direct
from cas.objects import readahead
from cas.objects.readahead import ReadAhead, advise_if_cold
from cas.repo.config import StoreConfig
from tests.helpers import uncache

pytestmark = pytest.mark.skipif(not readahead.usable(), reason="Linux only (RWF_NOWAIT)")

MiB = 1 << 20


def _cold_file(path: Path, nbytes: int) -> Path:
    """A file of ``nbytes`` on disk and out of the page cache; skips where pages cannot be
    dropped (tmpfs keeps them: there is no disk to read ahead from). Where the kernel counts a
    file's cached pages without reading (``cachestat``), the file itself is asked; elsewhere a
    canary beside it is probed, since a probe that misses starts the kernel reading that page
    in. A file was once taken as cold by its canary and found cached by the advice."""
    path.write_bytes(os.urandom(nbytes))
    for attempt in range(5):  # a page still in another CPU's LRU batch is not dropped at once
        canary = path.with_name(f"{path.name}.canary{attempt}")
        canary.write_bytes(os.urandom(nbytes))
        uncache(canary)
        uncache(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            counted = direct.cached_pages(fd)
        finally:
            os.close(fd)
        fd = os.open(canary, os.O_RDONLY)
        try:
            if counted in (0, None) and not readahead._cached(fd, nbytes - 4096):
                return path
        finally:
            os.close(fd)
        time.sleep(0.05)
    pytest.skip("this filesystem keeps a file's pages cached")


def test_a_cold_file_is_advised_and_a_cached_one_is_left_alone(tmp_path: Path) -> None:
    cold = _cold_file(tmp_path / "cold", 2 * MiB)
    assert advise_if_cold(cold)
    deadline = time.monotonic() + 10  # the kernel reads it in behind the advice
    fd = os.open(cold, os.O_RDONLY)
    try:
        while not readahead._cached(fd, 2 * MiB - 4096) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert readahead._cached(fd, 2 * MiB - 4096)
    finally:
        os.close(fd)
    assert not advise_if_cold(cold)  # now cached: nothing to ask
    assert not advise_if_cold(tmp_path / "missing")  # the reader reports that, not the advice


def test_the_advice_stays_its_window_ahead_of_the_readers(tmp_path: Path) -> None:
    files = [_cold_file(tmp_path / f"f{i}", MiB) for i in range(6)]
    ahead = ReadAhead(files, [MiB] * 6, window=2 * MiB).start()
    deadline = time.monotonic() + 10
    while len(ahead.advised) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert ahead.advised == files[:2]  # two files ahead, then it waits for the readers
    ahead.advance(MiB)
    while len(ahead.advised) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert ahead.advised == files[:3]
    ahead.stop()
    assert ahead.advised == files[:3]


def test_a_warm_load_ends_the_advice_after_a_run_of_cached_files(tmp_path: Path) -> None:
    files = []
    for i in range(readahead.WARM_RUN + 4):
        (tmp_path / f"w{i}").write_bytes(os.urandom(64 << 10))  # written buffered: cached
        files.append(tmp_path / f"w{i}")
    files.append(_cold_file(tmp_path / "late", MiB))
    ahead = ReadAhead(files, [64 << 10] * (len(files) - 1) + [MiB]).start()
    ahead._thread.join(10)
    assert not ahead._thread.is_alive() and ahead.advised == []


@pytest.mark.parametrize("cold_reads", [False, True])
def test_a_large_load_from_a_cold_store_is_read_ahead_and_loads_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold_reads: bool
) -> None:
    """Where cold files are read past the page cache (``direct.read_cold``), advice would only
    fill it: no read-ahead then."""
    monkeypatch.setattr(readahead, "MIN_BYTES", 4 * MiB)
    monkeypatch.setattr(direct, "_cold_reads", cold_reads and direct.cold_reads())
    store = tmp_path / "store"
    repo = cas.open(store, config=StoreConfig(chunk_size=MiB))
    state = {"w": np.random.default_rng(0).standard_normal(2 * MiB // 4 * 3).astype("f4")}
    repo.save(state, "runs/r1/ckpt")
    for path in (store / "chunks").rglob("*"):
        if path.is_file():
            uncache(path)
    _cold_file(tmp_path / "canary", MiB)  # skips where pages cannot be dropped
    advised: list[ReadAhead] = []
    start = ReadAhead.start

    def recorded(self: ReadAhead) -> ReadAhead:
        advised.append(self)
        return start(self)

    monkeypatch.setattr(ReadAhead, "start", recorded)
    loaded = cas.open(store).load("runs/r1/ckpt")
    assert np.array_equal(loaded["w"], state["w"])
    if direct.cold_reads():
        assert advised == []
    else:
        assert len(advised) == 1 and len(advised[0].paths) == 6 and advised[0].advised
