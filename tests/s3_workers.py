"""Functions run in child processes by the multi-writer tests (importable, so spawn/forkserver work)."""

from __future__ import annotations

import os
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any

import torch

import cas
from cas.errors import RefConflict

Report = tuple[int, str, str]
"""What a worker puts on its queue: its rank or seed, an outcome word, and the detail."""


def shard_state(rank: int, world_size: int, tensors_per_rank: int = 4) -> dict[str, Any]:
    """Rank ``rank``'s part of the checkpoint ``full_state(world_size)``."""
    generator = torch.Generator().manual_seed(1000 + rank)
    model = {
        f"r{rank}.layer{j}.weight": torch.randn(256, 96, generator=generator)
        for j in range(tensors_per_rank)
    }
    return {"step": 7, "model": model}


def full_state(world_size: int, tensors_per_rank: int = 4) -> dict[str, Any]:
    """What loading the committed checkpoint of ``world_size`` shards must return."""
    model: dict[str, Any] = {}
    for rank in range(world_size):
        model.update(shard_state(rank, world_size, tensors_per_rank)["model"])
    return {"step": 7, "model": model}


def racing_state(seed: int) -> dict[str, Any]:
    """The state racing writer ``seed`` saves."""
    return {"w": torch.randn(128, 64, generator=torch.Generator().manual_seed(seed))}


def save_shard_worker(
    url: str,
    env: dict[str, str],
    run_id: str,
    rank: int,
    world_size: int,
    barrier: Barrier,
    out: Queue[Report],
) -> None:
    """Save one shard once every rank reached the barrier; put (rank, digest or error) on ``out``."""
    os.environ.update(env)
    try:
        with cas.open(url) as repo:
            state = shard_state(rank, world_size)
            barrier.wait(timeout=60)
            out.put((rank, "ok", str(repo.save_shard(state, run_id, rank, world_size))))
    except Exception as e:
        out.put((rank, "error", f"{type(e).__name__}: {e}"))


def racing_save_worker(
    url: str,
    env: dict[str, str],
    ref: str,
    expected: str,
    seed: int,
    barrier: Barrier,
    out: Queue[Report],
) -> None:
    """Save to ``ref`` by compare-and-swap against ``expected``; put (seed, outcome, detail)."""
    os.environ.update(env)
    try:
        with cas.open(url) as repo:
            state = racing_state(seed)
            barrier.wait(timeout=60)
            try:
                # Replacing the gate by compare-and-swap is deliberate: overwrite=True.
                won = repo.save(state, ref, expected=expected, overwrite=True)
                out.put((seed, "won", str(won)))
            except RefConflict as e:
                out.put((seed, "conflict", str(e)))
    except Exception as e:
        out.put((seed, "error", f"{type(e).__name__}: {e}"))
