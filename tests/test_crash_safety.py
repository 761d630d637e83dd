"""Invariant 1: a writer killed at any moment leaves every ref loadable and no partial object."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

import cas
from cas.digest import Digest
from cas.objects.store import parse_envelope
from tests.crash_writer import expected_state, write_forever


def _check_every_object_is_whole(store: Path) -> None:
    """No partial file sits under a final name: every chunk and manifest decodes to its digest."""
    repo = cas.open(store)
    try:
        for prefix in ("chunks/", "manifests/"):
            for key in repo.blobs.list(prefix):
                digest = Digest(key.rsplit("/", 1)[1])
                parse_envelope(repo.blobs.get(key), 1 << 30)
                if prefix == "chunks/":
                    repo.objects.get_chunk(digest)
                else:
                    repo.objects.get_manifest(digest)
    finally:
        repo.close()


def _check_refs(store: Path) -> int:
    repo = cas.open(store)
    try:
        report = repo.verify(level="existence")
        assert report.ok, report.problems
        latest = repo.refs_store.try_get("runs/crash/latest")
        if latest is None:
            return 0
        step = repo.manifest("runs/crash/latest").meta["step"]
        loaded = repo.load("runs/crash/latest")
        expected = expected_state(step)
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), (step, key)
        return int(step)
    finally:
        repo.close()


@pytest.mark.slow
def test_sigkill_at_random_moments_never_breaks_a_ref(tmp_path: Path) -> None:
    store = tmp_path / "store"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "cas", "tests.crash_writer"])
    rng = random.Random(20261121)
    kills = 0
    last_step = 0
    for _ in range(55):
        writer = context.Process(target=write_forever, args=(str(store), last_step + 1))
        writer.start()
        time.sleep(rng.uniform(0.05, 0.6))
        assert writer.pid is not None
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        assert writer.exitcode == -signal.SIGKILL
        kills += 1
        step = _check_refs(store)
        assert step >= last_step  # the ref never goes back to an older checkpoint
        last_step = step
    _check_every_object_is_whole(store)
    assert kills >= 50 and last_step > 5
