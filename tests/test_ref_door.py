"""The ref door: every ref moves through ``RefStore.update``, one compare-and-swap loop.

The races here are forced, not hoped for: ``RaceBlobStore`` holds both writers at a barrier
right before their write, after each has read the same version, on every backend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import cas
from cas.blobstore import BlobStore, LocalBlobStore, MemoryBlobStore
from cas.digest import Digest, digest_of
from cas.errors import LeaseExpired, NotFound, RefConflict
from cas.refs.leases import LeaseManager, LeaseSettings
from cas.refs.records import RefRecord
from cas.refs.store import RefChange, RefStore
from cas.testing.races import RaceBlobStore
from tests.retention_helpers import FakeClock

REF = "runs/r/latest"


def target(label: str) -> Digest:
    """A distinct manifest digest (the door never reads what a ref points at)."""
    return digest_of(label.encode())


@pytest.fixture(
    params=["memory", "local", pytest.param("s3", marks=pytest.mark.s3)],
)
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    """The store two writers race on: in memory, on local disk, on S3 (SeaweedFS)."""
    if request.param == "memory":
        yield MemoryBlobStore()
    elif request.param == "local":
        yield LocalBlobStore(tmp_path / "store")
    else:
        url = request.getfixturevalue("s3_url")
        repo = cas.open(url)  # the S3 store as cas opens it: retries, conditional-write probe
        try:
            yield repo.blobs
        finally:
            repo.close()


def race(writers: list[Callable[[], str]]) -> list[str]:
    """Run each writer on its own thread; their outcomes, in writer order."""
    outcomes = [""] * len(writers)

    def run(index: int) -> None:
        try:
            outcomes[index] = writers[index]()
        except RefConflict:
            outcomes[index] = "conflict"
        except Exception as e:  # surfaced by the assertions, with its type
            outcomes[index] = f"error: {type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(writers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return outcomes


def racing_stores(blobs: BlobStore, writers: int = 2) -> tuple[RaceBlobStore, list[RefStore]]:
    """One RefStore per writer (as in separate processes), all writing through one barrier."""
    held = RaceBlobStore(blobs, threading.Barrier(writers), prefix="refs/")
    return held, [RefStore(held) for _ in range(writers)]


def history(blobs: BlobStore) -> list[Digest]:
    """The ref's targets, oldest first, read by a fresh store."""
    store = RefStore(blobs)
    return [e.target for e in reversed(list(store.events(store.get(REF))))]


def test_two_writers_from_one_version_exactly_one_wins(blobs: BlobStore) -> None:
    start = target("start")
    RefStore(blobs).set(REF, start)
    held, stores = racing_stores(blobs)
    mine = [target("writer 0"), target("writer 1")]

    def writer(index: int) -> Callable[[], str]:
        def write() -> str:
            stores[index].set(REF, mine[index], expected=start, op=f"writer {index}")
            return "won"

        return write

    outcomes = race([writer(0), writer(1)])
    assert sorted(outcomes) == ["conflict", "won"], outcomes
    assert held.held == 2  # both writes waited at the barrier, holding the version of `start`
    winner = mine[outcomes.index("won")]
    assert RefStore(blobs).get(REF).target == winner
    assert history(blobs) == [start, winner]  # the loser wrote nothing


def test_a_writer_that_loses_is_asked_again_with_the_winners_record(blobs: BlobStore) -> None:
    start = target("start")
    RefStore(blobs).set(REF, start)
    _, stores = racing_stores(blobs)
    mine = [target("writer 0"), target("writer 1")]
    seen: list[list[Digest | None]] = [[], []]

    def writer(index: int) -> Callable[[], str]:
        def decide(current: RefRecord | None) -> Digest:
            seen[index].append(current.target if current else None)
            return mine[index]

        def write() -> str:
            record = stores[index].update(REF, decide, op=f"writer {index}")
            assert record is not None and record.target == mine[index]
            return "done"

        return write

    assert race([writer(0), writer(1)]) == ["done", "done"]
    first = 0 if len(seen[0]) == 1 else 1
    second = 1 - first
    assert seen[first] == [start]
    assert seen[second] == [start, mine[first]]  # called again, with what the winner wrote
    assert history(blobs) == [start, mine[first], mine[second]]  # no update lost


def test_a_racing_delete_and_move_never_both_happen(blobs: BlobStore) -> None:
    start = target("start")
    RefStore(blobs).set(REF, start)
    _, stores = racing_stores(blobs)

    def delete() -> str:
        stores[0].delete(REF, expected=start)
        return "deleted"

    def move() -> str:
        stores[1].set(REF, target("moved"), expected=start)
        return "moved"

    outcomes = race([delete, move])
    assert sorted(outcomes) in (["conflict", "deleted"], ["conflict", "moved"]), outcomes
    remaining = RefStore(blobs).try_get(REF)
    if "deleted" in outcomes:
        assert remaining is None
    else:
        assert remaining is not None and remaining.target == target("moved")


def test_update_gives_up_with_ref_conflict_after_its_attempts() -> None:
    blobs = MemoryBlobStore()
    door, other = RefStore(blobs), RefStore(blobs)
    other.set(REF, target("0"))
    calls: list[Digest | None] = []

    def decide_while_another_writer_moves_it(current: RefRecord | None) -> Digest:
        calls.append(current.target if current else None)
        other.set(REF, target(str(len(calls))))  # lands between this read and this write
        return target("mine")

    with pytest.raises(RefConflict, match=r"ref 'runs/r/latest' .* rate lost .* 5 times"):
        door.update(REF, decide_while_another_writer_moves_it, op="rate", attempts=5)
    assert calls == [target(str(i)) for i in range(5)]  # each retry saw the newest record
    assert other.get(REF).target == target("5")


def test_keep_writes_nothing_and_delete_removes() -> None:
    blobs = MemoryBlobStore()
    store = RefStore(blobs)
    assert store.update(REF, lambda current: RefChange.KEEP, op="noop") is None
    assert store.try_get(REF) is None
    created = store.update(REF, lambda current: target("a"), op="create")
    assert created is not None and created.target == target("a")
    kept = store.update(REF, lambda current: RefChange.KEEP, op="noop")
    assert kept is not None and kept.version == created.version and kept.depth == 1
    assert store.update(REF, lambda current: RefChange.DELETE, op="drop") is None
    assert store.try_get(REF) is None
    assert store.update(REF, lambda current: RefChange.DELETE, op="drop") is None
    with pytest.raises(NotFound):
        store.delete(REF)


def test_an_update_function_that_raises_aborts_and_writes_nothing() -> None:
    store = RefStore(MemoryBlobStore())
    store.set(REF, target("a"))

    def refuse(current: RefRecord | None) -> Digest:
        raise ValueError("not this one")

    with pytest.raises(ValueError, match="not this one"):
        store.update(REF, refuse, op="refuse")
    assert store.get(REF).depth == 1


def test_a_writer_whose_lease_expired_cannot_move_a_ref() -> None:
    clock = FakeClock(1000.0)
    blobs = MemoryBlobStore(clock)
    leases = LeaseManager(blobs, clock, LeaseSettings(duration=600, margin=60))
    store = RefStore(blobs, clock, leases)
    store.set(REF, target("a"))
    with leases.hold("slow writer"), pytest.raises(LeaseExpired):
        clock.advance(600)
        store.update(REF, lambda current: target("b"), op="late")
    assert store.get(REF).target == target("a")
