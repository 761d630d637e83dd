"""BlobStoreConformance: the one test suite every BlobStore backend and wrapper must pass.

A backend's test is a subclass that says how to make a fresh, empty store::

    class TestLocalBlobStore(BlobStoreConformance):
        def make_store(self) -> BlobStore:
            return LocalBlobStore(self.tmp_path / "store")

``self.tmp_path`` is pytest's per-test directory and ``self.fixture(name)`` fetches any other
fixture (for example a per-test S3 URL). The compare-and-swap and racing create-only tests run
only where ``supports_conditional_writes`` is true, unless the subclass sets
``conditional_writes = True`` for a backend whose compare-and-swap is safe within one process only.
"""

from __future__ import annotations

import abc
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cas.blobstore.base import BlobStore
from cas.errors import InvalidName, NotFound, PreconditionFailed

MiB = 1 << 20
INVALID_KEYS = ("../x", "/abs", "a//b", "a\x00b", "", "a/", "./x", "a/../b")


class ManualClock:
    """A clock that moves only when told to; pass it to stores that take ``clock=``."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        with self._lock:
            self._now += seconds


def _blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


class BlobStoreConformance(abc.ABC):
    """The BlobStore contract as tests; subclass it and implement ``make_store``."""

    conditional_writes: bool | None = None
    """None: test compare-and-swap only if the store supports it; True: test it regardless."""
    clock: ManualClock | None = None
    """Set it in ``make_store`` when the store reads this clock, so tests need not sleep."""

    tmp_path: Path
    request: pytest.FixtureRequest

    @abc.abstractmethod
    def make_store(self) -> BlobStore:
        """A fresh, empty store; called once per test."""

    def fixture(self, name: str) -> Any:
        """The value of another pytest fixture, for ``make_store``."""
        return self.request.getfixturevalue(name)

    @pytest.fixture(autouse=True)
    def _conformance_context(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.request = request
        self.tmp_path = tmp_path

    @pytest.fixture
    def store(self) -> Iterator[BlobStore]:
        """The store under test, closed afterwards."""
        store = self.make_store()
        try:
            yield store
        finally:
            store.close()

    def require_conditional_writes(self, store: BlobStore) -> None:
        """Skip the calling test when the store cannot compare-and-swap."""
        if self.conditional_writes is None and not store.supports_conditional_writes:
            pytest.skip(f"{type(store).__name__} does not support conditional writes")

    @pytest.mark.parametrize("size", [0, 1, 5 * MiB], ids=["empty", "one-byte", "5MiB"])
    def test_put_then_get_returns_the_same_bytes(self, store: BlobStore, size: int) -> None:
        data = _blob(size, seed=size)
        store.put("chunks/blob", data)
        assert store.get("chunks/blob") == data

    def test_put_accepts_bytearray_and_memoryview(self, store: BlobStore) -> None:
        store.put("a", bytearray(b"from bytearray"))
        store.put("b", memoryview(b"xx from memoryview xx")[3:-3])
        assert store.get("a") == b"from bytearray"
        assert store.get("b") == b"from memoryview"

    def test_put_overwrites_the_previous_blob(self, store: BlobStore) -> None:
        store.put("refs/head", b"first version, longer")
        store.put("refs/head", b"second")
        assert store.get("refs/head") == b"second"
        assert store.stat("refs/head").size == len(b"second")

    def test_readers_never_see_a_partial_overwrite(self, store: BlobStore) -> None:
        versions = {i: bytes([i]) * (4 * MiB) for i in range(1, 7)}
        store.put("chunks/hot", versions[1])
        torn: list[str] = []
        writing = threading.Event()
        writing.set()

        def read_until_writer_done() -> int:
            reads = 0
            while writing.is_set() or reads == 0:
                data = store.get("chunks/hot")
                reads += 1
                if not data or versions.get(data[0]) != data:
                    torn.append(f"read {len(data)} bytes starting {data[:1]!r}")
            return reads

        with ThreadPoolExecutor(2) as pool:
            readers = [pool.submit(read_until_writer_done) for _ in range(2)]
            try:
                for i in (2, 3, 4, 5, 6, 1):
                    store.put("chunks/hot", versions[i])
            finally:
                writing.clear()
            assert all(reader.result() > 0 for reader in readers)
        assert torn == []

    def test_a_transient_put_is_a_whole_visible_replacement(self, store: BlobStore) -> None:
        store.put_transient("leases/w1", b"first lease document, longer")
        assert store.get("leases/w1") == b"first lease document, longer"
        store.put_transient("leases/w1", b"refreshed")
        assert store.get("leases/w1") == b"refreshed"
        assert store.stat("leases/w1").size == len(b"refreshed")
        assert list(store.list("leases/")) == ["leases/w1"]

    def test_a_written_blob_is_visible_at_once(self, store: BlobStore) -> None:
        for i in range(5):
            key = f"chunks/{i:02d}/blob"
            store.put(key, b"x" * i)
            assert store.has(key)
            assert store.stat(key).size == i
            assert key in set(store.list("chunks/"))
            assert store.get(key) == b"x" * i

    def test_get_range_returns_the_slice_clamped_to_the_blob(self, store: BlobStore) -> None:
        data = bytes(range(256)) * 4
        store.put("chunks/r", data)
        assert store.get_range("chunks/r", 0, 10) == data[:10]
        assert store.get_range("chunks/r", 500, 600) == data[500:600]
        assert store.get_range("chunks/r", 1000, 1024) == data[1000:]
        assert store.get_range("chunks/r", 1000, 5000) == data[1000:]
        assert store.get_range("chunks/r", 2000, 3000) == b""
        assert store.get_range("chunks/r", 7, 7) == b""

    def test_get_range_of_an_empty_blob_is_empty(self, store: BlobStore) -> None:
        store.put("chunks/empty", b"")
        assert store.get_range("chunks/empty", 0, 10) == b""

    def test_a_missing_key_raises_not_found(self, store: BlobStore) -> None:
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: store.get("chunks/missing"),
            "get_range": lambda: store.get_range("chunks/missing", 0, 10),
            "get_range empty": lambda: store.get_range("chunks/missing", 3, 3),
            "stat": lambda: store.stat("chunks/missing"),
            "get_versioned": lambda: store.get_versioned("chunks/missing"),
            "touch": lambda: store.touch("chunks/missing"),
        }
        for name, call in calls.items():
            with pytest.raises(NotFound) as caught:
                call()
            assert isinstance(caught.value, FileNotFoundError), name
        assert not store.has("chunks/missing")
        assert list(store.list("chunks/")) == []

    def test_delete_removes_the_blob_and_is_idempotent(self, store: BlobStore) -> None:
        store.put("chunks/d", b"doomed")
        store.delete("chunks/d")
        assert not store.has("chunks/d")
        with pytest.raises(NotFound):
            store.get("chunks/d")
        store.delete("chunks/d")
        store.delete("never/existed")

    def test_list_yields_keys_by_plain_string_prefix(self, store: BlobStore) -> None:
        keys = {"chunks/ab/1", "chunks/ab/2", "chunks/ac/3", "chunks/b/4", "refs/main", "top"}
        for key in keys:
            store.put(key, key.encode())
        assert set(store.list()) == keys
        assert set(store.list("")) == keys
        assert set(store.list("chunks/")) == {k for k in keys if k.startswith("chunks/")}
        assert set(store.list("chunks/a")) == {"chunks/ab/1", "chunks/ab/2", "chunks/ac/3"}
        assert set(store.list("chunks/ab/")) == {"chunks/ab/1", "chunks/ab/2"}
        assert set(store.list("chunks/ab/1")) == {"chunks/ab/1"}
        assert set(store.list("t")) == {"top"}
        assert list(store.list("nothing/")) == []

    def test_list_info_reports_every_size(self, store: BlobStore) -> None:
        sizes = {"chunks/a": 0, "chunks/b": 1, "chunks/c": 1000, "other/d": 5}
        for key, size in sizes.items():
            store.put(key, b"z" * size)
        infos = {info.key: info for info in store.list_info("chunks/")}
        assert {key: info.size for key, info in infos.items()} == {
            k: v for k, v in sizes.items() if k.startswith("chunks/")
        }
        assert all(info.mtime > 0 for info in infos.values())

    def test_stat_reports_size_and_mtime(self, store: BlobStore) -> None:
        store.put("chunks/s", b"12345")
        info = store.stat("chunks/s")
        assert (info.key, info.size) == ("chunks/s", 5)
        assert info.mtime > 0

    def test_has_many_answers_for_every_key(self, store: BlobStore) -> None:
        store.put("chunks/1", b"1")
        store.put("chunks/3", b"3")
        keys = [f"chunks/{i}" for i in range(6)]
        assert store.has_many(keys) == {key: key in ("chunks/1", "chunks/3") for key in keys}

    def test_touch_moves_mtime_forward_and_keeps_the_bytes(self, store: BlobStore) -> None:
        store.put("chunks/t", b"keep me")
        before = store.stat("chunks/t").mtime
        if self.clock is not None:
            self.clock.advance(60.0)
        store.touch("chunks/t")
        after = store.stat("chunks/t").mtime
        if after <= before and self.clock is None:
            # Some backends (S3) keep whole seconds: wait for the next one and touch again.
            time.sleep(1.1)
            store.touch("chunks/t")
            after = store.stat("chunks/t").mtime
        assert after > before
        assert store.get("chunks/t") == b"keep me"

    def test_put_new_parts_creates_once_and_keeps_the_first_bytes(self, store: BlobStore) -> None:
        first = (b"first ", bytearray(b"writer's "), memoryview(b"xx bytes xx")[3:-3])
        assert store.put_new_parts("chunks/ab/new", first) is True
        assert store.get("chunks/ab/new") == b"first writer's bytes"
        assert store.put_new_parts("chunks/ab/new", (b"second",)) is False
        assert store.get("chunks/ab/new") == b"first writer's bytes"
        assert store.stat("chunks/ab/new").size == len(b"first writer's bytes")
        store.put("chunks/ab/old", b"put first")
        assert store.put_new_parts("chunks/ab/old", (b"created later",)) is False
        assert store.get("chunks/ab/old") == b"put first"
        assert set(store.list("chunks/")) == {"chunks/ab/new", "chunks/ab/old"}

    def test_racing_put_new_parts_has_exactly_one_winner(self, store: BlobStore) -> None:
        self.require_conditional_writes(store)
        writers, rounds = 8, 4
        for round_ in range(rounds):
            key = f"chunks/race/{round_}"
            start = threading.Barrier(writers)

            def create(writer: int, key: str = key, start: threading.Barrier = start) -> bool:
                payload = (f"writer {writer} ".encode(), _blob(256 << 10, seed=writer))
                start.wait()
                return store.put_new_parts(key, payload)

            with ThreadPoolExecutor(writers) as pool:
                created = list(pool.map(create, range(writers)))
            assert created.count(True) == 1, created
            winner = created.index(True)
            assert store.get(key) == f"writer {winner} ".encode() + _blob(256 << 10, seed=winner)

    def test_create_if_absent_succeeds_once(self, store: BlobStore) -> None:
        self.require_conditional_writes(store)
        version = store.put_conditional("refs/new", b"one", None)
        with pytest.raises(PreconditionFailed):
            store.put_conditional("refs/new", b"two", None)
        assert store.get_versioned("refs/new") == (b"one", version)

    def test_replace_with_the_current_version_succeeds(self, store: BlobStore) -> None:
        self.require_conditional_writes(store)
        first = store.put_conditional("refs/r", b"v1", None)
        second = store.put_conditional("refs/r", b"v2", first)
        assert store.get_versioned("refs/r") == (b"v2", second)
        third = store.put_conditional("refs/r", b"v3", second)
        assert store.get_versioned("refs/r") == (b"v3", third)

    def test_a_stale_version_is_refused_and_changes_nothing(self, store: BlobStore) -> None:
        self.require_conditional_writes(store)
        stale = store.put_conditional("refs/s", b"old", None)
        current = store.put_conditional("refs/s", b"new", stale)
        with pytest.raises(PreconditionFailed):
            store.put_conditional("refs/s", b"lost update", stale)
        assert store.get_versioned("refs/s") == (b"new", current)
        with pytest.raises(PreconditionFailed):
            store.put_conditional("refs/absent", b"x", current)
        assert not store.has("refs/absent")

    def test_delete_conditional_needs_the_current_version(self, store: BlobStore) -> None:
        self.require_conditional_writes(store)
        old = store.put_conditional("refs/d", b"old", None)
        current = store.put_conditional("refs/d", b"new", old)
        with pytest.raises(PreconditionFailed):
            store.delete_conditional("refs/d", old)
        assert store.get("refs/d") == b"new"
        store.delete_conditional("refs/d", current)
        assert not store.has("refs/d")
        with pytest.raises(PreconditionFailed):
            store.delete_conditional("refs/d", current)

    def test_racing_writers_lose_no_update(self, store: BlobStore) -> None:
        self.require_conditional_writes(store)
        writers, increments = 8, 4
        store.put_conditional("refs/counter", b"0 start", None)

        def increment_repeatedly(writer: int) -> int:
            conflicts = 0
            for _ in range(increments):
                while True:
                    data, version = store.get_versioned("refs/counter")
                    # A unique token per write, as real refs carry (see RetryingBlobStore).
                    new = f"{int(data.split()[0]) + 1} {writer}-{uuid.uuid4().hex}".encode()
                    try:
                        store.put_conditional("refs/counter", new, version)
                        break
                    except PreconditionFailed:
                        conflicts += 1
            return conflicts

        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(increment_repeatedly, range(writers)))
        assert int(store.get("refs/counter").split()[0]) == writers * increments

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    def test_unsafe_keys_are_refused(self, store: BlobStore, key: str) -> None:
        calls: dict[str, Callable[[], object]] = {
            "put": lambda: store.put(key, b"x"),
            "get": lambda: store.get(key),
            "get_range": lambda: store.get_range(key, 0, 1),
            "has": lambda: store.has(key),
            "stat": lambda: store.stat(key),
            "delete": lambda: store.delete(key),
            "put_conditional": lambda: store.put_conditional(key, b"x", None),
            "put_new_parts": lambda: store.put_new_parts(key, (b"x",)),
        }
        for name, call in calls.items():
            with pytest.raises(InvalidName):
                call()
                pytest.fail(f"{name}({key!r}) was accepted")
        assert list(store.list()) == []
