"""The opponent pool: versions that never repeat, anchors, re-rating without weights, sampling."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import cas
from cas.errors import NotFound
from cas.training.pool import FrozenAnchor, OpponentPool, PoolEntry

PREFIX = "runs/r1/phase3/opponent_pool"


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"w": torch.randn(64, 64), "b": torch.randn(64)}


def chunk_count(repo: cas.Repository) -> int:
    return len(list(repo.blobs.list("chunks/")))


@pytest.fixture
def repo(tmp_path: Path) -> cas.Repository:
    return cas.open(tmp_path / "store")


def test_pool_versions_survive_restarts_and_never_repeat(repo: cas.Repository) -> None:
    seen: list[int] = []
    for restart in range(3):
        pool = OpponentPool(repo, PREFIX, capacity=2)  # a new process each time
        for i in range(3):
            seen.append(pool.promote(weights(restart * 10 + i), step=100 * len(seen)).version)
    assert seen == list(range(1, 10))
    pool = OpponentPool(repo, PREFIX, capacity=2)
    assert [e.version for e in pool.entries()] == [8, 9]
    assert [e["version"] for e in pool.evictions()] == list(range(1, 8))
    assert pool.next_version() == 10


def test_versions_never_repeat_even_if_the_counter_ref_is_deleted(repo: cas.Repository) -> None:
    pool = OpponentPool(repo, PREFIX, capacity=1)
    for i in range(3):
        pool.promote(weights(i))
    repo.rm(pool.counter_ref)
    assert pool.promote(weights(9)).version == 4


def test_concurrent_promotions_get_distinct_versions(repo: cas.Repository) -> None:
    versions: list[int] = []
    lock = threading.Lock()

    def promoter(seed: int) -> None:
        pool = OpponentPool(repo, PREFIX, capacity=100)
        for i in range(4):
            entry = pool.promote(weights(seed * 10 + i), step=seed * 10 + i)
            with lock:
                versions.append(entry.version)

    threads = [threading.Thread(target=promoter, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(versions) == list(range(1, 13))


def test_anchors_are_never_evicted_and_never_rerated(repo: cas.Repository) -> None:
    repo.save({"model": weights(100)}, "gates/bc_best")
    repo.save({"model": weights(101)}, "gates/distill_best")
    pool = OpponentPool(repo, PREFIX, capacity=3)
    pool.add_anchor("gates/distill_best", "distill_best", {"mu": 25.0, "sigma": 1.0})
    pool.add_anchor("gates/bc_best", "bc_best", {"mu": 20.0, "sigma": 1.0})
    for i in range(10):
        pool.promote({"model": weights(i)}, {"mu": 25.0 + i, "sigma": 8.3}, step=500 * i)
    entries = pool.entries()
    assert [e.name for e in entries if e.anchor] == ["distill_best", "bc_best"]
    assert [e.version for e in entries if not e.anchor] == [10, 11, 12]
    with pytest.raises(FrozenAnchor):
        pool.update(1, mu=99.0)
    assert torch.equal(pool.load(2)["model"]["w"], weights(100)["w"])


def test_rerating_writes_no_chunk_bytes_and_keeps_the_weights(repo: cas.Repository) -> None:
    pool = OpponentPool(repo, PREFIX)
    entry = pool.promote(weights(1), {"mu": 25.0, "sigma": 8.33, "games": 0}, step=500)
    chunks = chunk_count(repo)
    rated = pool.update(entry.version, mu=27.5, sigma=4.0, games=120, win_rate=0.31)
    assert chunk_count(repo) == chunks
    assert (rated.mu, rated.sigma, rated.games, rated.win_rate) == (27.5, 4.0, 120, 0.31)
    assert rated.conservative_rating == pytest.approx(15.5)
    assert repo.show(entry.ref)["meta"]["pool"]["games"] == 120
    assert repo.manifest(rated.digest).tensors == repo.manifest(entry.digest).tensors
    assert torch.equal(pool.load(entry.version)["w"], weights(1)["w"])


def test_eviction_log_keeps_the_rating_history_of_evicted_models(repo: cas.Repository) -> None:
    pool = OpponentPool(repo, PREFIX, capacity=1, clock=lambda: 1000.0)
    first = pool.promote(weights(1), {"mu": 25.0, "sigma": 8.0}, step=500, phase=3)
    pool.update(first.version, mu=30.0, sigma=2.0, games=400, win_rate=0.27)
    pool.promote(weights(2), step=1000, phase=3)
    (logged,) = pool.evictions()
    assert logged["version"] == 1 and logged["mu"] == 30.0 and logged["games"] == 400
    assert logged["win_rate"] == 0.27 and logged["ref"] == first.ref
    with pytest.raises(NotFound):
        pool.load(first.version)


def test_an_eviction_racing_a_rerate_removes_the_model_and_logs_its_last_rating(
    repo: cas.Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = OpponentPool(repo, "league", capacity=1)
    rater = OpponentPool(repo, "league", capacity=1)  # another process
    pool.promote({"w": torch.zeros(4)}, {"mu": 25.0})
    log_eviction = pool._log_eviction
    raced: list[int] = []

    def log_then_rerate(entry: PoolEntry) -> None:
        log_eviction(entry)
        if not raced:  # the rater writes once, between the log and the ref delete
            raced.append(1)
            rater.update(1, mu=31.0, games=10)

    monkeypatch.setattr(pool, "_log_eviction", log_then_rerate)
    pool.promote({"w": torch.ones(4)}, {"mu": 25.0})  # evicts v1
    assert raced and [e.version for e in pool.entries()] == [2]
    (logged,) = pool.evictions()
    assert (logged["version"], logged["mu"], logged["games"]) == (1, 31.0, 10)


def test_promoting_from_a_checkpoint_ref_copies_only_the_model_and_writes_no_chunk(
    repo: cas.Repository,
) -> None:
    with cas.CheckpointManager(repo, run="r1", phase=3, signals=False) as mgr:
        opt_state = {"exp_avg": torch.zeros(64, 64)}
        mgr.save(500, {"model": weights(3), "optimizer": opt_state}).result()
        pool = mgr.pool(capacity=5)
        chunks = chunk_count(repo)
        entry = pool.promote(mgr.latest_ref, step=500, only="state.model.*")
    assert chunk_count(repo) == chunks
    assert entry.ref == f"{PREFIX}/pool_v0001_step00000500"
    loaded = pool.load(entry.version)
    assert set(loaded) == {"model"} and torch.equal(loaded["model"]["w"], weights(3)["w"])


def test_sampling_is_a_pure_function_of_seed_and_roster(repo: cas.Repository) -> None:
    pool = OpponentPool(repo, PREFIX, capacity=20)
    for i in range(6):
        pool.promote(weights(i), step=i)
    first = [e.version for e in pool.sample(50, seed=42)]
    again = [e.version for e in OpponentPool(repo, PREFIX).sample(50, seed=42)]
    other = [e.version for e in pool.sample(50, seed=43)]
    assert first == again and first != other
    assert set(first) == set(range(1, 7))
    continued = [e.version for e in pool.sample(25, seed=42, start=25)]
    assert continued == first[25:]
