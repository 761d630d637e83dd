"""RetryingBlobStore rides out transient faults without turning them into wrong answers."""

from __future__ import annotations

import random

import pytest

from cas.blobstore import MemoryBlobStore
from cas.blobstore.retry import RetryingBlobStore, RetryPolicy
from cas.errors import InvalidName, NotFound, PreconditionFailed, TransientBackendError
from cas.testing.faulty import FaultyBlobStore


def _retrying(
    faulty: FaultyBlobStore, policy: RetryPolicy | None = None
) -> tuple[RetryingBlobStore, list[float]]:
    sleeps: list[float] = []
    store = RetryingBlobStore(faulty, policy, sleep=sleeps.append, rng=random.Random(1))
    return store, sleeps


def test_transient_failures_are_retried_after_capped_growing_delays() -> None:
    faulty = FaultyBlobStore(MemoryBlobStore())
    faulty.inner.put("chunks/a", b"data")
    store, sleeps = _retrying(faulty, RetryPolicy(attempts=5, base_delay=0.1, max_delay=0.3))
    faulty.fail_next("get", 4)
    assert store.get("chunks/a") == b"data"
    assert (faulty.calls["get"], faulty.faults["get"]) == (5, 4)
    caps = [0.1, 0.2, 0.3, 0.3]
    assert len(sleeps) == 4
    assert all(0.0 <= slept <= cap for slept, cap in zip(sleeps, caps, strict=True))


def test_retrying_gives_up_after_the_policy_attempts() -> None:
    faulty = FaultyBlobStore(MemoryBlobStore())
    store, sleeps = _retrying(faulty, RetryPolicy(attempts=3))
    faulty.fail_next("put", 10)
    with pytest.raises(TransientBackendError):
        store.put("chunks/a", b"data")
    assert faulty.calls["put"] == 3
    assert len(sleeps) == 2


def test_answers_are_never_retried() -> None:
    faulty = FaultyBlobStore(MemoryBlobStore())
    store, sleeps = _retrying(faulty)
    version = store.put_conditional("refs/main", b"one", None)
    with pytest.raises(NotFound):
        store.get("chunks/missing")
    with pytest.raises(PreconditionFailed):
        store.put_conditional("refs/main", b"two", None)
    with pytest.raises(InvalidName):
        store.put("../escape", b"x")
    assert (faulty.calls["get"], faulty.calls["put_conditional"], faulty.calls["put"]) == (1, 2, 1)
    assert sleeps == []
    assert store.get_versioned("refs/main") == (b"one", version)


def test_a_conditional_write_that_landed_before_failing_is_not_a_conflict() -> None:
    faulty = FaultyBlobStore(MemoryBlobStore())
    store, _ = _retrying(faulty)
    first = store.put_conditional("refs/main", b"one writer-1", None)
    faulty.fail_next("put_conditional", after_write=True)
    second = store.put_conditional("refs/main", b"two writer-1", first)
    assert faulty.inner.get_versioned("refs/main") == (b"two writer-1", second)
    assert faulty.calls["put_conditional"] == 3


def test_a_real_conflict_after_a_transient_failure_is_still_a_conflict() -> None:
    faulty = FaultyBlobStore(MemoryBlobStore())
    store, _ = _retrying(faulty)
    stale = store.put_conditional("refs/main", b"one", None)
    theirs = faulty.inner.put_conditional("refs/main", b"theirs", stale)
    faulty.fail_next("put_conditional")
    with pytest.raises(PreconditionFailed):
        store.put_conditional("refs/main", b"ours", stale)
    assert faulty.inner.get_versioned("refs/main") == (b"theirs", theirs)


def test_a_conditional_delete_that_landed_before_failing_counts_as_done() -> None:
    faulty = FaultyBlobStore(MemoryBlobStore())
    store, _ = _retrying(faulty)
    version = store.put_conditional("refs/old", b"x", None)
    faulty.fail_next("delete_conditional", after_write=True)
    store.delete_conditional("refs/old", version)
    assert not faulty.inner.has("refs/old")


def test_a_create_only_put_that_landed_before_failing_counts_as_created() -> None:
    faulty = FaultyBlobStore(MemoryBlobStore())
    store, _ = _retrying(faulty)
    faulty.fail_next("put_if_absent", after_write=True)
    assert store.put_if_absent("chunks/a", (b"our ", b"bytes")) is True
    assert faulty.calls["put_if_absent"] == 2
    assert faulty.inner.get("chunks/a") == b"our bytes"


def test_a_create_only_put_that_finds_other_bytes_after_a_failure_lost() -> None:
    faulty = FaultyBlobStore(MemoryBlobStore())
    store, _ = _retrying(faulty)
    faulty.inner.put("chunks/a", b"their bytes")
    faulty.fail_next("put_if_absent")
    assert store.put_if_absent("chunks/a", (b"our bytes",)) is False
    assert faulty.inner.get("chunks/a") == b"their bytes"


def test_fault_injection_replays_exactly_from_its_seed() -> None:
    def fault_pattern(seed: int) -> list[str]:
        """Per put: "ok", or where the injected fault struck ("before" / "after" the write)."""
        faulty = FaultyBlobStore(
            MemoryBlobStore(), rate=0.3, rates={"has": 0.0}, after_write=0.5, seed=seed
        )
        pattern = []
        for i in range(200):
            key = f"chunks/{i}"
            try:
                faulty.put(key, b"x")
                outcome = "ok"
            except TransientBackendError as e:
                outcome = "after" if "after" in str(e) else "before"
            pattern.append(outcome)
            # The fault says truthfully whether the write happened, and a method with rate 0
            # never fails and answers from the store.
            assert faulty.has(key) is (outcome != "before"), (i, outcome)
            assert faulty.inner.has(key) is (outcome != "before"), (i, outcome)
        assert faulty.calls["has"] == 200 and faulty.faults["has"] == 0
        assert faulty.faults["put"] == 200 - pattern.count("ok")
        return pattern

    first = fault_pattern(3)
    assert fault_pattern(3) == first
    assert fault_pattern(4) != first
    assert 30 < 200 - first.count("ok") < 90
    assert first.count("before") > 10 and first.count("after") > 10


def test_a_retry_policy_needs_one_attempt_and_non_negative_delays() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(base_delay=-1.0)
