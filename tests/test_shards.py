"""Many writers, one store: sharded saves committed as one checkpoint, and racing refs."""

from __future__ import annotations

import multiprocessing
import os
import queue
import uuid
from collections.abc import Callable
from multiprocessing.queues import Queue
from pathlib import Path

import pytest
import torch

import cas
from cas.errors import CASError, FormatError, NotFound
from cas.repo.shards import STAGING_PREFIX
from tests.helpers import assert_bit_exact, small_chunk_repo
from tests.s3_workers import (
    Report,
    full_state,
    racing_save_worker,
    racing_state,
    save_shard_worker,
    shard_state,
)


def _aws_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}


def _run_processes(
    target: Callable[..., None], arg_lists: list[tuple[object, ...]]
) -> list[Report]:
    """Start one process per argument tuple behind a shared barrier; collect what they report."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "cas", "tests.s3_workers"])
    barrier = context.Barrier(len(arg_lists))
    results: Queue[Report] = context.Queue()
    processes = [
        context.Process(target=target, args=(*args, barrier, results)) for args in arg_lists
    ]
    for process in processes:
        process.start()
    collected: list[Report] = []
    try:
        for _ in processes:
            collected.append(results.get(timeout=120))
    except queue.Empty:
        pytest.fail(f"only {len(collected)} of {len(processes)} writers reported: {collected}")
    finally:
        for process in processes:
            process.join(timeout=30)
    return sorted(collected)


@pytest.mark.s3
@pytest.mark.slow
def test_four_processes_save_shards_into_one_bucket_and_the_combined_load_is_the_original(
    s3_url: str,
) -> None:
    world_size = 4
    run_id = f"run_{uuid.uuid4().hex[:8]}"
    cas.open(s3_url)  # create the store once, before the writers race to

    reports = _run_processes(
        save_shard_worker,
        [(s3_url, _aws_env(), run_id, rank, world_size) for rank in range(world_size)],
    )

    assert [(rank, outcome) for rank, outcome, _ in reports] == [
        (r, "ok") for r in range(world_size)
    ]
    repo = cas.open(s3_url)
    digest = repo.commit_shards("runs/sharded/ckpt_step00000007", run_id, world_size)
    assert repo.resolve("runs/sharded/ckpt_step00000007") == digest
    assert_bit_exact(repo.load("runs/sharded/ckpt_step00000007"), full_state(world_size))
    assert list(repo.refs_store.names(STAGING_PREFIX)) == []  # staging refs are cleaned up
    assert repo.manifest(digest).meta["shards"]["world_size"] == world_size


@pytest.mark.s3
def test_two_processes_racing_on_one_ref_one_wins_and_both_checkpoints_are_kept(
    s3_url: str,
) -> None:
    repo = cas.open(s3_url)
    base = repo.save({"w": torch.zeros(4)}, "gates/best")

    reports = _run_processes(
        racing_save_worker, [(s3_url, _aws_env(), "gates/best", base, seed) for seed in (1, 2)]
    )

    outcomes = sorted(outcome for _, outcome, _ in reports)
    assert outcomes == ["conflict", "won"], reports
    winner_seed, _, winner = next(r for r in reports if r[1] == "won")
    loser_seed, _, message = next(r for r in reports if r[1] == "conflict")
    assert "stored" in message
    assert repo.resolve("gates/best") == winner
    assert_bit_exact(repo.load("gates/best"), racing_state(winner_seed))
    stored = {key.rpartition("/")[2] for key in repo.blobs.list("manifests/")}
    loser = (stored - {base, winner}).pop()
    assert loser in message  # the conflict names the manifest it stored
    assert_bit_exact(repo.load(loser), racing_state(loser_seed))


def test_shards_merge_into_one_state_with_replicated_values_kept_once(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store")
    for rank in range(3):
        repo.save_shard(shard_state(rank, 3), "r1", rank, 3)

    digest = repo.commit_shards("runs/r1/ckpt", "r1", 3, metadata={"step": 7})

    assert_bit_exact(repo.load("runs/r1/ckpt"), full_state(3))
    assert repo.manifest(digest).meta["step"] == 7


def test_ranks_layout_keeps_each_shard_under_its_rank(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store")
    rng_states = [{"rng": torch.full((8,), float(rank))} for rank in range(2)]
    for rank, state in enumerate(rng_states):
        repo.save_shard(state, "r2", rank, 2)

    repo.commit_shards("runs/r2/rng", "r2", 2, layout="ranks")

    assert_bit_exact(repo.load("runs/r2/rng"), {"rank0": rng_states[0], "rank1": rng_states[1]})


def test_shards_that_disagree_on_a_shared_key_are_refused(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store")
    repo.save_shard({"step": 1, "a": torch.ones(4)}, "r3", 0, 2)
    repo.save_shard({"step": 2, "b": torch.ones(4)}, "r3", 1, 2)

    with pytest.raises(FormatError, match="step"):
        repo.commit_shards("runs/r3/ckpt", "r3", 2)
    assert repo.refs_store.try_get("runs/r3/ckpt") is None


def test_committing_before_every_rank_saved_names_the_missing_ranks(tmp_path: Path) -> None:
    repo = small_chunk_repo(tmp_path / "store")
    repo.save_shard({"a": torch.ones(4)}, "r4", 1, 4)
    waited: list[float] = []

    with pytest.raises(NotFound, match=r"rank\(s\) 0, 2, 3 of 4"):
        repo.commit_shards("runs/r4/ckpt", "r4", 4, timeout=0.5, poll=0.1, sleep=waited.append)
    assert waited  # it polled before giving up


@pytest.mark.s3
def test_an_s3_server_without_conditional_writes_is_refused_for_writers(s3_url: str) -> None:
    cas.open(s3_url).save({"a": torch.ones(4)}, "a")

    with pytest.raises(CASError, match="single_writer=True"):
        cas.open(s3_url, conditional_writes=False)
    reader = cas.open(s3_url, readonly=True, conditional_writes=False)
    assert_bit_exact(reader.load("a"), {"a": torch.ones(4)})
    lone = cas.open(s3_url, single_writer=True, conditional_writes=False)
    lone.save({"b": torch.ones(4)}, "b")
    with pytest.raises(CASError, match="sharded saves need"):
        lone.save_shard({"c": torch.ones(4)}, "r5", 0, 1)
