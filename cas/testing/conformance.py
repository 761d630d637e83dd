"""The BlobStore contract as tests: every backend and wrapper runs them as a one-line subclass.

A backend's test is a subclass that says how to make a fresh, empty store::

    class TestLocalBlobStore(BlobStoreConformance):
        def make_store(self) -> BlobStore:
            return LocalBlobStore(self.tmp_path / "store")

``self.tmp_path`` is pytest's per-test directory and ``self.fixture(name)`` fetches any other
fixture (for example a per-test S3 URL). The compare-and-swap and racing create-only tests run
only where ``supports_conditional_writes`` is true, unless the subclass sets
``conditional_writes = True`` for a backend whose compare-and-swap is safe within one process only.

``BlobStoreReadConformance`` is the read half (it stores its fixtures through ``writer(store)``);
``ReadOnlyConformance`` runs it on a read-only view and checks that every write is refused.
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
from cas.blobstore.bulk import has_many, read_into, touch_many
from cas.blobstore.wrapper import WRITE_METHODS
from cas.codecs import codec_by_name
from cas.errors import IntegrityError, InvalidName, NotFound, PreconditionFailed, ReadOnlyError
from cas.objects.keys import ObjectKind
from cas.objects.store import ObjectStore, chunk_key
from cas.refs.keys import HASH_MARK, HASHED_HEAD, MAX_PLAIN_NAME, REFS_PREFIX

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


class BlobStoreReadConformance(abc.ABC):
    """What every store answers about blobs stored in it; subclass it and implement ``make_store``."""

    conditional_writes: bool | None = None
    """None: test compare-and-swap only if the store supports it; True: test it regardless."""
    clock: ManualClock | None = None
    """Set it in ``make_store`` when the store reads this clock, so tests need not sleep."""

    tmp_path: Path
    request: pytest.FixtureRequest

    @abc.abstractmethod
    def make_store(self) -> BlobStore:
        """A fresh, empty store; called once per test."""

    def writer(self, store: BlobStore) -> BlobStore:
        """The handle the tests store their fixtures through: the store itself by default."""
        return store

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
    def test_get_returns_the_stored_bytes(self, store: BlobStore, size: int) -> None:
        data = _blob(size, seed=size)
        self.writer(store).put("chunks/blob", data)
        assert store.get("chunks/blob") == data

    def test_get_range_returns_the_slice_clamped_to_the_blob(self, store: BlobStore) -> None:
        data = bytes(range(256)) * 4
        self.writer(store).put("chunks/r", data)
        assert store.get_range("chunks/r", 0, 10) == data[:10]
        assert store.get_range("chunks/r", 500, 600) == data[500:600]
        assert store.get_range("chunks/r", 1000, 1024) == data[1000:]
        assert store.get_range("chunks/r", 1000, 5000) == data[1000:]
        assert store.get_range("chunks/r", 2000, 3000) == b""
        assert store.get_range("chunks/r", 7, 7) == b""

    def test_get_range_of_an_empty_blob_is_empty(self, store: BlobStore) -> None:
        self.writer(store).put("chunks/empty", b"")
        assert store.get_range("chunks/empty", 0, 10) == b""

    def test_a_missing_key_raises_not_found(self, store: BlobStore) -> None:
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: store.get("chunks/missing"),
            "get_range": lambda: store.get_range("chunks/missing", 0, 10),
            "get_range empty": lambda: store.get_range("chunks/missing", 3, 3),
            "stat": lambda: store.stat("chunks/missing"),
            "get_versioned": lambda: store.get_versioned("chunks/missing"),
            "read_into": lambda: read_into(store, "chunks/missing", 0, [memoryview(bytearray(4))]),
        }
        for name, call in calls.items():
            with pytest.raises(NotFound) as caught:
                call()
            assert isinstance(caught.value, FileNotFoundError), name
        assert not store.has("chunks/missing")
        assert list(store.list("chunks/")) == []

    def test_a_prefix_of_other_keys_is_no_blob(self, store: BlobStore) -> None:
        self.writer(store).put("chunks/ab/cd", b"the only blob")
        for directory in ("chunks", "chunks/ab"):
            assert not store.has(directory)
            for call in (store.get, store.stat, store.get_versioned):
                with pytest.raises(NotFound):
                    call(directory)
            with pytest.raises(NotFound):
                store.get_range(directory, 0, 10)
        assert list(store.list("chunks")) == ["chunks/ab/cd"]
        assert [info.key for info in store.list_info("")] == ["chunks/ab/cd"]

    def test_list_yields_keys_by_plain_string_prefix(self, store: BlobStore) -> None:
        keys = {"chunks/ab/1", "chunks/ab/2", "chunks/ac/3", "chunks/b/4", "refs/main", "top"}
        for key in keys:
            self.writer(store).put(key, key.encode())
        assert set(store.list()) == keys
        assert set(store.list("")) == keys
        assert set(store.list("chunks/")) == {k for k in keys if k.startswith("chunks/")}
        assert set(store.list("chunks/a")) == {"chunks/ab/1", "chunks/ab/2", "chunks/ac/3"}
        assert set(store.list("chunks/ab/")) == {"chunks/ab/1", "chunks/ab/2"}
        assert set(store.list("chunks/ab/1")) == {"chunks/ab/1"}
        assert set(store.list("t")) == {"top"}
        assert list(store.list("nothing/")) == []
        listed = list(store.list())
        assert len(listed) == len(set(listed))  # each blob once

    def test_every_shape_of_ref_key_is_stored_and_listed(self, store: BlobStore) -> None:
        # The longest plain ref key, a long name's hashed key and a name a temp file could have.
        keys = {
            REFS_PREFIX + "a" * MAX_PLAIN_NAME,
            REFS_PREFIX + "b%40" * (HASHED_HEAD // 4) + HASH_MARK + "c" * 64,
            REFS_PREFIX + "x.tmp",
        }
        for key in keys:
            self.writer(store).put(key, key.encode())
        assert set(store.list(REFS_PREFIX)) == keys
        assert all(store.get(key) == key.encode() for key in keys)

    def test_list_info_reports_every_size(self, store: BlobStore) -> None:
        sizes = {"chunks/a": 0, "chunks/b": 1, "chunks/c": 1000, "other/d": 5}
        for key, size in sizes.items():
            self.writer(store).put(key, b"z" * size)
        infos = {info.key: info for info in store.list_info("chunks/")}
        assert {key: info.size for key, info in infos.items()} == {
            k: v for k, v in sizes.items() if k.startswith("chunks/")
        }
        assert all(info.mtime > 0 for info in infos.values())

    def test_stat_reports_size_and_mtime(self, store: BlobStore) -> None:
        self.writer(store).put("chunks/s", b"12345")
        info = store.stat("chunks/s")
        assert (info.key, info.size) == ("chunks/s", 5)
        assert info.mtime > 0

    def test_has_many_answers_for_every_key(self, store: BlobStore) -> None:
        self.writer(store).put("chunks/1", b"1")
        self.writer(store).put("chunks/3", b"3")
        keys = [f"chunks/{i}" for i in range(6)]
        assert has_many(store, keys) == {key: key in ("chunks/1", "chunks/3") for key in keys}
        assert has_many(store, keys[:2]) == {"chunks/0": False, "chunks/1": True}

    def test_an_unchanged_blob_keeps_its_version(self, store: BlobStore) -> None:
        self.writer(store).put("refs/v", b"same bytes")
        first = store.get_versioned("refs/v")
        assert store.get_versioned("refs/v") == first == (b"same bytes", first[1])

    def test_read_into_fills_the_buffers_in_order_and_stops_at_the_end(
        self, store: BlobStore
    ) -> None:
        data = _blob(10_000, seed=3)
        self.writer(store).put("chunks/r", data)
        head, body, tail = (memoryview(bytearray(n)) for n in (16, 4000, 8000))
        assert read_into(store, "chunks/r", 0, [head, body, tail]) == len(data)
        assert bytes(head) + bytes(body) + bytes(tail[: len(data) - 4016]) == data
        out = memoryview(bytearray(100))
        assert read_into(store, "chunks/r", 9950, [out]) == 50
        assert bytes(out[:50]) == data[9950:]
        assert read_into(store, "chunks/r", 20_000, [out]) == 0

    def test_local_files_are_where_local_root_says(self, store: BlobStore) -> None:
        self.writer(store).put("chunks/ab/f", b"in a file")
        root = store.local_root
        path = store.local_path("chunks/ab/f")
        # A store may also read in place by a way of its own (a sealed one decrypts its local
        # files into the reader's buffers): reads_in_place then holds without a local_root.
        assert store.reads_in_place or root is None
        if root is None:
            assert path is None
            assert not store.supports_rename
            return
        assert path == root / "chunks" / "ab" / "f"
        assert path.read_bytes() == b"in a file"

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    def test_unsafe_keys_are_refused_by_reads(self, store: BlobStore, key: str) -> None:
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: store.get(key),
            "get_range": lambda: store.get_range(key, 0, 1),
            "has": lambda: store.has(key),
            "stat": lambda: store.stat(key),
            "get_versioned": lambda: store.get_versioned(key),
        }
        for name, call in calls.items():
            with pytest.raises(InvalidName):
                call()
                pytest.fail(f"{name}({key!r}) was accepted")


class BlobStoreConformance(BlobStoreReadConformance):
    """The whole BlobStore contract: what the read half checks, and every kind of write."""

    def test_put_accepts_bytearray_memoryview_and_parts(self, store: BlobStore) -> None:
        store.put("a", bytearray(b"from bytearray"))
        store.put("b", memoryview(b"xx from memoryview xx")[3:-3])
        store.put("c", (b"from ", bytearray(b"several "), memoryview(b"xxparts")[2:]))
        store.put("d", [])
        assert store.get("a") == b"from bytearray"
        assert store.get("b") == b"from memoryview"
        assert store.get("c") == b"from several parts"
        assert store.get("d") == b""

    def test_put_overwrites_the_previous_blob(self, store: BlobStore) -> None:
        store.put("refs/head", b"first version, longer")
        store.put("refs/head", b"second")
        assert store.get("refs/head") == b"second"
        assert store.stat("refs/head").size == len(b"second")

    def test_a_large_blob_is_stored_whole(self, store: BlobStore) -> None:
        # Above the part size a backend may send in pieces (S3: multipart uploads, ranged GETs).
        data = _blob(12 * MiB + 5, seed=12)
        store.put("chunks/large", (data[:100], memoryview(data)[100:]))
        assert store.get("chunks/large") == data
        assert store.stat("chunks/large").size == len(data)
        assert store.put_if_absent("chunks/large-new", data) is True
        assert store.put_if_absent("chunks/large-new", _blob(12 * MiB + 5, seed=13)) is False
        assert store.get("chunks/large-new") == data

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

    def test_delete_removes_the_blob_and_is_idempotent(self, store: BlobStore) -> None:
        store.put("chunks/d", b"doomed")
        store.delete("chunks/d")
        assert not store.has("chunks/d")
        with pytest.raises(NotFound):
            store.get("chunks/d")
        store.delete("chunks/d")
        store.delete("never/existed")

    def test_touch_moves_mtime_forward_and_keeps_bytes_and_version(self, store: BlobStore) -> None:
        store.put("chunks/t", b"keep me")
        _, version = store.get_versioned("chunks/t")
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
        assert store.get_versioned("chunks/t") == (b"keep me", version)

    def test_touching_a_missing_key_raises_not_found(self, store: BlobStore) -> None:
        store.put("chunks/ab/present", b"x")
        for key in ("chunks/missing", "chunks/ab"):
            with pytest.raises(NotFound) as caught:
                store.touch(key)
            assert isinstance(caught.value, FileNotFoundError)
        assert touch_many(store, ["chunks/ab/present", "chunks/gone", "chunks/ab"]) == [
            "chunks/gone",
            "chunks/ab",
        ]
        assert list(store.list()) == ["chunks/ab/present"]

    def test_dropping_a_cached_copy_loses_nothing(self, store: BlobStore) -> None:
        store.put("chunks/c", b"stored once")
        store.get("chunks/c")
        assert isinstance(store.drop_cached("chunks/c"), bool)
        assert store.get("chunks/c") == b"stored once"
        assert store.drop_cached("chunks/never") is False

    def test_put_if_absent_creates_once_and_keeps_the_first_bytes(self, store: BlobStore) -> None:
        first = (b"first ", bytearray(b"writer's "), memoryview(b"xx bytes xx")[3:-3])
        assert store.put_if_absent("chunks/ab/new", first) is True
        assert store.get("chunks/ab/new") == b"first writer's bytes"
        assert store.put_if_absent("chunks/ab/new", b"second") is False
        assert store.get("chunks/ab/new") == b"first writer's bytes"
        assert store.stat("chunks/ab/new").size == len(b"first writer's bytes")
        store.put("chunks/ab/old", b"put first")
        assert store.put_if_absent("chunks/ab/old", (b"created later",)) is False
        assert store.get("chunks/ab/old") == b"put first"
        assert set(store.list("chunks/")) == {"chunks/ab/new", "chunks/ab/old"}

    def test_put_if_absent_named_asks_the_name_once_and_creates_only(
        self, store: BlobStore
    ) -> None:
        asked: list[str] = []

        def name(key: str) -> Callable[[], str]:
            def ask() -> str:
                asked.append(key)
                return key

            return ask

        assert store.put_if_absent_named(name("chunks/cd/new"), (b"named ", b"bytes")) is True
        assert store.get("chunks/cd/new") == b"named bytes" and asked == ["chunks/cd/new"]
        assert store.put_if_absent_named(name("chunks/cd/new"), b"other") is False
        assert store.get("chunks/cd/new") == b"named bytes"

        def no_name() -> str:
            raise IntegrityError("the bytes changed while they were hashed")

        with pytest.raises(IntegrityError):
            store.put_if_absent_named(no_name, b"never named")
        assert set(store.list("")) == {"chunks/cd/new"}  # nothing left under any name

    def test_a_deleted_key_can_be_created_again(self, store: BlobStore) -> None:
        assert store.put_if_absent("chunks/again", b"one") is True
        store.delete("chunks/again")
        assert store.put_if_absent("chunks/again", b"two") is True
        assert store.get("chunks/again") == b"two"

    def test_racing_put_if_absent_has_exactly_one_winner(self, store: BlobStore) -> None:
        self.require_conditional_writes(store)
        writers, rounds = 8, 4
        for round_ in range(rounds):
            key = f"chunks/race/{round_}"
            start = threading.Barrier(writers)

            def create(writer: int, key: str = key, start: threading.Barrier = start) -> bool:
                payload = (f"writer {writer} ".encode(), _blob(256 << 10, seed=writer))
                start.wait()
                return store.put_if_absent(key, payload)

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
    def test_unsafe_keys_are_refused_by_writes(self, store: BlobStore, key: str) -> None:
        calls: dict[str, Callable[[], object]] = {
            "put": lambda: store.put(key, b"x"),
            "put_transient": lambda: store.put_transient(key, b"x"),
            "put_if_absent": lambda: store.put_if_absent(key, (b"x",)),
            "put_conditional": lambda: store.put_conditional(key, b"x", None),
            "touch": lambda: store.touch(key),
            "delete": lambda: store.delete(key),
        }
        for name, call in calls.items():
            with pytest.raises(InvalidName):
                call()
                pytest.fail(f"{name}({key!r}) was accepted")
        assert list(store.list()) == []

    def test_a_corrupt_chunk_is_quarantined_and_healed_by_the_next_put(
        self, store: BlobStore
    ) -> None:
        objects = ObjectStore(store)
        data = _blob(10_000, 5)
        digest = objects.put_chunk(data, codec_by_name("raw")).digest
        rotted = _rot(store, chunk_key(digest))
        with pytest.raises(IntegrityError, match="moved aside"):
            objects.get_chunk(digest)
        assert not objects.has_chunk(digest)
        [record] = objects.quarantined()
        assert (record.kind, record.digest, record.operation) == ("chunks", digest, "read")
        assert store.get(record.key) == rotted
        with pytest.raises(IntegrityError, match="quarantined"):
            objects.get_chunk(digest)
        assert list(objects.list_objects(ObjectKind.CHUNK)) == []  # no object is listed there
        assert objects.put_chunk(data, codec_by_name("zstd")).new
        assert bytes(objects.get_chunk(digest)) == data

    def test_a_small_corrupt_chunk_no_reader_has_seen_is_rewritten_by_the_next_put(
        self, store: BlobStore
    ) -> None:
        objects = ObjectStore(store)
        data = _blob(3000, 8)
        digest = objects.put_chunk(data, codec_by_name("raw")).digest
        _rot(store, chunk_key(digest))
        assert objects.put_chunk(data, codec_by_name("raw")).new  # not reused as it was
        assert bytes(objects.get_chunk(digest)) == data
        assert objects.quarantined() == []


def _rot(store: BlobStore, key: str) -> bytes:
    """Flip one byte of the blob's last byte in place, as bit rot would; the bytes now stored."""
    rotted = bytearray(store.get(key))
    rotted[-1] ^= 0x40
    store.put(key, bytes(rotted))
    return bytes(rotted)


class ReadOnlyConformance(BlobStoreReadConformance):
    """A read-only view (``make_store`` returns a wrapper of a writable store): it answers every
    read like the store beneath it, and refuses every write with ReadOnlyError."""

    def writer(self, store: BlobStore) -> BlobStore:
        inner = getattr(store, "inner", None)  # every wrapper keeps the store it wraps there
        assert isinstance(inner, BlobStore), "a read-only view wraps the store beneath it"
        return inner

    def test_every_write_is_refused_and_changes_nothing(self, store: BlobStore) -> None:
        beneath = self.writer(store)
        beneath.put("refs/main", b"before")
        _, version = beneath.get_versioned("refs/main")
        mtime = beneath.stat("refs/main").mtime
        writes: dict[str, Callable[[], object]] = {
            "put": lambda: store.put("refs/main", b"after"),
            "put_if_absent": lambda: store.put_if_absent("chunks/new", (b"x",)),
            "put_transient": lambda: store.put_transient("leases/w", b"x"),
            "put_conditional": lambda: store.put_conditional("refs/main", b"after", version),
            "touch": lambda: store.touch("refs/main"),
            "delete": lambda: store.delete("refs/main"),
            "delete_conditional": lambda: store.delete_conditional("refs/main", version),
        }
        assert set(writes) == set(WRITE_METHODS)
        for name, write in writes.items():
            with pytest.raises(ReadOnlyError):
                write()
                pytest.fail(f"{name} was accepted")
        assert beneath.get_versioned("refs/main") == (b"before", version)
        assert beneath.stat("refs/main").mtime == mtime
        assert list(beneath.list()) == ["refs/main"]

    def test_gc_may_not_rename_its_files(self, store: BlobStore) -> None:
        assert not store.supports_rename

    def test_a_corrupt_chunk_is_refused_though_it_cannot_be_moved_aside(
        self, store: BlobStore
    ) -> None:
        beneath = self.writer(store)
        digest = ObjectStore(beneath).put_chunk(_blob(5000, 6), codec_by_name("raw")).digest
        rotted = _rot(beneath, chunk_key(digest))
        objects = ObjectStore(store)
        with pytest.raises(IntegrityError) as raised:
            objects.get_chunk(digest)
        assert "moved aside" not in str(raised.value)
        assert beneath.get(chunk_key(digest)) == rotted
        assert list(beneath.list("quarantine/")) == []
