"""The remote tier under faults, against a real SeaweedFS: a training process killed at many
points of its drain, S3 stopped and started while training goes on, a remote GC racing the
drain, two runs draining into one bucket, and the local disk filling while S3 is down."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import cas
from cas.errors import BackendError
from cas.retention.gc import GCSettings
from cas.retention.policy import RetentionPolicy, Rule
from cas.testing.seaweed import SeaweedServer
from cas.training.manager import CheckpointManager
from tests import tier_workers as workers
from tests.helpers import assert_bit_exact

KILLS = 50
FIRST_KILL = 6
"""The first requests open the remote (its capability probe); the drain's start after them."""
KILL_STRIDE, KILL_SPAN = 7, 45
"""Kill points spread over the next 45 requests: a restarted run's first drain cycles, which
finish what the killed one left."""
CKPT = "runs/{run}/phase1/ckpt_phase1_step{step:08d}"


def _remote(seaweed: SeaweedServer, prefix: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint_url)
    return f"s3://crash/{prefix}"


def _check_remote_whole(remote: cas.Repository) -> None:
    """Invariant 14: every remote ref, ``latest`` included, names chunks that are all there."""
    report = remote.verify(level="existence")
    assert report.ok, report.problems


def _large(step: int) -> dict[str, torch.Tensor]:
    """1 MiB of new weights per save: an 8 MiB disk fills in a few."""
    return {"w": torch.randn(1 << 18, generator=torch.Generator().manual_seed(step))}


def _kept_by_remote_policy(step: int) -> bool:
    return str(step)[-1] in "048"


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_run_killed_at_50_points_of_its_drain_loses_nothing_the_remote_policy_keeps(
    private_seaweed: SeaweedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """``process``: the drain's requests are made by its worker process (the default), which
    kills itself and the training process at its N-th request, as losing the node would;
    ``thread``: by a thread of the training process (``CAS_DRAIN=thread``)."""
    url = _remote(private_seaweed, "killed", monkeypatch)
    local = str(tmp_path / "local")
    # fork, not forkserver: a forkserver child takes a second to start on a busy machine, and
    # the worker opens its own stores (nothing it uses is shared with this process).
    context = multiprocessing.get_context("fork")
    killed = 0
    for i in range(KILLS):
        kill_at = FIRST_KILL + (i * KILL_STRIDE) % KILL_SPAN
        worker = context.Process(
            target=workers.train_until_killed, args=(local, url, "r1", kill_at, mode)
        )
        worker.start()
        worker.join(timeout=60)
        assert worker.exitcode is not None, f"no kill at request {kill_at} within a minute"
        killed += worker.exitcode == -signal.SIGKILL
        remote = cas.open(url)
        # The remote's latest never names a checkpoint whose chunks are not all there.
        whole = remote.verify(["runs/r1/latest"] if remote.find_ref("runs/r1/latest") else [])
        assert whole.ok, whole.problems
        if i % 10 == 9:
            _check_remote_whole(remote)
    assert killed == KILLS
    remote = cas.open(url)
    # The next run finishes the drain it inherits, then nothing the remote keeps is missing.
    repo = cas.open(local, config=workers.CONFIG)
    with CheckpointManager(
        repo, run="r1", signals=False, remote=remote, remote_policy=workers.REMOTE_POLICY
    ) as last:
        assert last.tier is not None and last.tier.wait(240).saves == 0
        newest = last.restore("auto").step
    assert newest > 10  # the killed runs got somewhere
    on_remote = set(remote.ref_names("runs/r1/phase1/ckpt_*"))
    for step in range(1, newest + 1):
        if _kept_by_remote_policy(step):
            assert CKPT.format(run="r1", step=step) in on_remote, step
    assert remote.resolve("runs/r1/latest") == repo.resolve("runs/r1/latest")
    assert_bit_exact(remote.load("runs/r1/latest")["state"], workers.weights(newest))
    _check_remote_whole(remote)


def test_training_goes_on_while_s3_is_down_and_the_drain_catches_up(
    private_seaweed: SeaweedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _remote(private_seaweed, "outage", monkeypatch)
    local = cas.open(tmp_path / "local", config=workers.CONFIG)
    mgr = CheckpointManager(local, run="r1", signals=False, remote=url)
    assert mgr.tier is not None
    mgr.tier.retry = mgr.tier.max_retry = 0.5  # retry often: the outage is short here
    mgr.save(1, workers.weights(1)).result()
    assert mgr.tier.wait(30).saves == 0
    private_seaweed.stop()
    blocked = []
    for step in range(2, 8):
        pending = mgr.save(step, workers.weights(step))
        blocked.append(pending.blocking_seconds)
        saved = pending.result()
    assert saved.remote_lag is not None and saved.remote_lag.saves >= 5
    assert max(blocked) < 1.0  # the loop only copied its state; S3 being down cost it nothing
    private_seaweed.start()
    deadline = time.monotonic() + 90
    while (lag := mgr.tier.wait(5)).saves and time.monotonic() < deadline:
        pass
    assert lag.saves == 0 and lag.error is None
    mgr.close()
    remote = cas.open(url)
    for step in range(1, 8):
        assert remote.resolve(CKPT.format(run="r1", step=step)) == local.resolve(
            CKPT.format(run="r1", step=step)
        )
    assert remote.resolve("runs/r1/latest") == local.resolve(CKPT.format(run="r1", step=7))
    _check_remote_whole(remote)


def test_a_remote_gc_racing_the_drain_sweeps_nothing_a_drained_checkpoint_needs(
    s3_url: str, tmp_path: Path
) -> None:
    remote = cas.open(s3_url, config=workers.CONFIG)
    remote.store_gc_settings(GCSettings(grace=0.0, reflog_window=0.0))
    stop = threading.Event()
    collected = []

    def collect() -> None:
        while not stop.is_set():
            with contextlib.suppress(cas.CASError):  # the drain's forget holds the lock
                collected.append(remote.plan_gc().execute())
            time.sleep(0.05)

    gc = threading.Thread(target=collect)
    gc.start()
    local = cas.open(tmp_path / "local", config=workers.CONFIG)
    try:
        with CheckpointManager(
            local, run="r1", signals=False, remote=remote, remote_policy=workers.REMOTE_POLICY
        ) as mgr:
            for step in range(1, 13):
                mgr.save(step, workers.weights(step)).result()
                time.sleep(0.05)  # a training step: the drain keeps up, GC runs in between
            assert mgr.tier is not None and mgr.tier.wait(60).saves == 0
    finally:
        stop.set()
        gc.join()
    assert collected  # GC ran alongside
    remote.plan_gc().execute()  # and once more after: the remote policy's forget freed refs
    _check_remote_whole(remote)
    for step in (4, 8, 10, 11, 12):
        ref = CKPT.format(run="r1", step=step)
        assert_bit_exact(remote.load(ref)["state"], workers.weights(step))


def test_two_runs_drain_into_one_bucket_and_share_their_backbone_chunks(
    s3_url: str, tmp_path: Path
) -> None:
    def train(run: str) -> None:
        local = cas.open(tmp_path / run, config=workers.CONFIG)
        with CheckpointManager(local, run=run, signals=False, remote=s3_url) as mgr:
            for step in range(1, 5):
                mgr.save(step, workers.weights(step + (100 if run == "b" else 0))).result()
            assert mgr.tier is not None and mgr.tier.wait(60).saves == 0

    runs = [threading.Thread(target=train, args=(run,)) for run in ("a", "b")]
    for thread in runs:
        thread.start()
    for thread in runs:
        thread.join()
    remote = cas.open(s3_url)
    _check_remote_whole(remote)
    for run, offset in (("a", 0), ("b", 100)):
        state = remote.load(f"runs/{run}/latest")["state"]
        assert_bit_exact(state, workers.weights(4 + offset))
    # The backbone, identical in both runs, is the same chunks: stored once.
    a, b = (set(remote.manifest(f"runs/{run}/latest").chunk_digests()) for run in ("a", "b"))
    assert a & b


def test_a_full_local_disk_while_s3_is_down_fails_the_save_in_one_line_and_keeps_latest(
    private_seaweed: SeaweedServer, small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _remote(private_seaweed, "full", monkeypatch)
    local = cas.open(small_disk / "local", config=workers.CONFIG)
    keep_one = RetentionPolicy(rules=(Rule("runs/*/phase*/ckpt_*", keep_last=1),))
    mgr = CheckpointManager(
        local, run="r1", signals=False, async_save=False, policy=keep_one, remote=url
    )
    private_seaweed.stop()
    step, error = 0, None
    while error is None and step < 100:
        step += 1
        try:
            mgr.save(step, _large(step))
        except BackendError as e:
            error = e
    assert error is not None, "the 8 MiB disk never filled"
    message = str(error)
    assert len(message.splitlines()) == 1
    assert "No space left on device" in message
    assert "checkpoints wait for the remote" in message
    # Nothing was deleted for room: the remote (no policy: it keeps everything) lacks them all.
    assert len(local.ref_names("runs/r1/phase1/ckpt_*")) == step - 1
    assert local.resolve("runs/r1/latest") == local.resolve(CKPT.format(run="r1", step=step - 1))
    assert_bit_exact(local.load("runs/r1/latest")["state"], _large(step - 1))
    assert mgr.tier is not None
    mgr.tier.close(0)
    mgr.close()
