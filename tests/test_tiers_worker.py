"""The remote tier's drain worker: the drain's requests are made by a process of their own, so
the training process's interpreter lock stays with the loop (``cas.training.drain_worker``).
Against a real SeaweedFS: the worker makes every request, is started again after it is killed,
and exits with the training process."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cas
from cas.repo.repository import Repository
from cas.training.drain_worker import ENV_MODE, InProcessRemote, WorkerRemote
from cas.training.manager import CheckpointManager
from cas.training.priority import ENV_BACKGROUND_CPUS, ENV_CPUS, drain_cpus
from tests.helpers import assert_bit_exact


def _weights(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(4096, generator=torch.Generator().manual_seed(step))}


@pytest.fixture
def requests_here(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The S3 operations this process makes, in order."""
    from botocore.client import BaseClient

    made: list[str] = []
    original = BaseClient._make_api_call

    def counted(self: Any, operation: str, params: Any) -> Any:
        made.append(operation)
        return original(self, operation, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", counted)
    yield made


def _worker(mgr: CheckpointManager) -> WorkerRemote:
    assert mgr.tier is not None
    ops = mgr.tier._ops
    assert isinstance(ops, WorkerRemote)
    return ops


def _first_drain(mgr: CheckpointManager) -> subprocess.Popen[bytes]:
    """Save step 1, wait until it is on the remote: the worker that drained it."""
    assert mgr.tier is not None
    mgr.save(1, _weights(1)).result()
    assert mgr.tier.wait(60).saves == 0
    process = _worker(mgr)._process
    assert process is not None
    return process


def test_the_drain_makes_its_requests_in_a_worker_process(
    s3_url: str, tmp_path: Path, requests_here: list[str]
) -> None:
    local = cas.open(tmp_path / "local")
    with CheckpointManager(local, run="r1", signals=False, remote=s3_url) as mgr:
        for step in range(1, 4):
            mgr.save(step, _weights(step)).result()
        assert mgr.tier is not None and mgr.tier.wait(60).saves == 0
        worker = _worker(mgr)._process
        assert worker is not None and worker.pid != os.getpid()
    assert requests_here == []  # not one request from the training process
    remote = cas.open(s3_url)
    assert remote.resolve("runs/r1/latest") == local.resolve("runs/r1/latest")
    assert_bit_exact(remote.load("runs/r1/latest")["state"], _weights(3))
    assert worker.poll() is not None  # closing the manager ended it


def test_with_a_worker_the_training_process_decodes_no_manifest_to_drain(
    s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunks of each checkpoint pushed (the next drain's ``known``) come back from the
    worker, which read them where it drained: the drain thread of the training process used to
    decode each new manifest for them, most of its CPU per save (docs/training.md)."""
    decoded_here: list[str] = []
    original = Repository.manifest

    def manifest(self: Repository, *args: Any, **kwargs: Any) -> Any:
        decoded_here.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Repository, "manifest", manifest)
    known: list[Any] = []
    drain = WorkerRemote.drain

    def spied(self: WorkerRemote, *args: Any, **kwargs: Any) -> Any:
        known.append(kwargs.get("known"))
        return drain(self, *args, **kwargs)

    monkeypatch.setattr(WorkerRemote, "drain", spied)
    local = cas.open(tmp_path / "local")
    with CheckpointManager(local, run="r1", signals=False, remote=s3_url) as mgr:
        for step in range(1, 5):
            mgr.save(step, _weights(step)).result()
            assert mgr.tier is not None and mgr.tier.wait(60).saves == 0
    assert "cas-drain" not in decoded_here
    # The first drain of the run asks the remote; each later one is told the chunks before.
    assert known[0] is None and all(k for k in known[1:]) and len(known) == 4
    assert_bit_exact(cas.open(s3_url).load("runs/r1/latest")["state"], _weights(4))


def test_with_cas_drain_thread_the_training_process_makes_the_requests(
    s3_url: str, tmp_path: Path, requests_here: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_MODE, "thread")
    local = cas.open(tmp_path / "local")
    with CheckpointManager(local, run="r1", signals=False, remote=s3_url) as mgr:
        assert mgr.tier is not None and isinstance(mgr.tier._ops, InProcessRemote)
        mgr.save(1, _weights(1)).result()
        assert mgr.tier.wait(60).saves == 0
    assert "PutObject" in requests_here
    assert cas.open(s3_url).resolve("runs/r1/latest") == local.resolve("runs/r1/latest")


def test_an_unknown_cas_drain_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_MODE, "fork")
    with pytest.raises(ValueError, match="CAS_DRAIN must be 'process' or 'thread', got 'fork'"):
        CheckpointManager(
            cas.open(tmp_path / "local"), run="r1", signals=False, remote=str(tmp_path / "r")
        )


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
@pytest.mark.parametrize("variable", [ENV_CPUS, ENV_BACKGROUND_CPUS])
def test_cas_drain_cpus_keeps_the_drain_and_its_worker_on_those_cpus(
    s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    everywhere = os.sched_getaffinity(0)
    cpu = max(everywhere)
    monkeypatch.setenv(variable, str(cpu))  # CAS_BACKGROUND_CPUS covers the drain too
    local = cas.open(tmp_path / "local")
    with CheckpointManager(local, run="r1", signals=False, remote=s3_url) as mgr:
        worker = _first_drain(mgr)
        assert os.sched_getaffinity(worker.pid) == {cpu}
        assert mgr.tier is not None
        drain_thread = mgr.tier._thread.native_id
        assert drain_thread is not None and os.sched_getaffinity(drain_thread) == {cpu}
        assert os.sched_getaffinity(0) == everywhere  # the loop's thread stays where it was
    assert cas.open(s3_url).resolve("runs/r1/latest") == local.resolve("runs/r1/latest")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
@pytest.mark.parametrize(
    ("value", "message"),
    [("two", "must list CPUs as in '3' or '2-5,7', got 'two'"), ("4096", "may not use")],
)
@pytest.mark.parametrize(("variable", "remote"), [(ENV_CPUS, True), (ENV_BACKGROUND_CPUS, False)])
def test_a_bad_cas_drain_cpus_is_one_clear_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    value: str,
    message: str,
    variable: str,
    remote: bool,
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}.*{message}|{message}"):
        CheckpointManager(
            cas.open(tmp_path / "local"), run="r1", signals=False,
            remote=str(tmp_path / "r") if remote else None,
        )  # fmt: skip


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_cas_drain_cpus_wins_over_cas_background_cpus_for_the_drain() -> None:
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    both = {ENV_CPUS: str(first), ENV_BACKGROUND_CPUS: str(last)}
    assert drain_cpus(both) == frozenset({first})
    assert drain_cpus({ENV_BACKGROUND_CPUS: str(last)}) == frozenset({last})
    assert drain_cpus({}) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_cas_background_cpus_keeps_a_background_save_and_its_chunk_workers_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cas.objects.store import ObjectStore

    everywhere = os.sched_getaffinity(0)
    cpu = max(everywhere)
    monkeypatch.setenv(ENV_BACKGROUND_CPUS, str(cpu))
    seen: dict[int, frozenset[int]] = {}  # thread -> its CPUs, for each thread writing a chunk
    put_chunk = ObjectStore.put_chunk

    def recorded(self: ObjectStore, *args: Any, **kwargs: Any) -> Any:
        seen[threading.get_native_id()] = frozenset(os.sched_getaffinity(0))
        return put_chunk(self, *args, **kwargs)

    monkeypatch.setattr(ObjectStore, "put_chunk", recorded)
    local = cas.open(tmp_path / "local")
    weights = {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))}
    with CheckpointManager(local, run="r1", signals=False) as mgr:
        mgr.save(1, weights).result()
        assert os.sched_getaffinity(0) == everywhere  # the loop's thread stays where it was
    assert seen and set(seen.values()) == {frozenset({cpu})}
    assert threading.get_native_id() not in seen
    assert_bit_exact(local.load("runs/r1/latest")["state"], weights)


def test_stores_a_worker_cannot_reopen_drain_in_a_thread(tmp_path: Path) -> None:
    local = cas.open(tmp_path / "local")
    remote = cas.open(tmp_path / "remote")
    with CheckpointManager(local, run="r1", signals=False, remote=remote) as mgr:
        assert mgr.tier is not None and isinstance(mgr.tier._ops, InProcessRemote)
    skewed = cas.open(tmp_path / "local", clock=lambda: time.time() + 3600)
    with CheckpointManager(skewed, run="r1", signals=False, remote=str(tmp_path / "r")) as mgr:
        assert mgr.tier is not None and isinstance(mgr.tier._ops, InProcessRemote)


def test_a_killed_worker_is_started_again_and_the_drain_catches_up(
    s3_url: str, tmp_path: Path
) -> None:
    local = cas.open(tmp_path / "local")
    with CheckpointManager(local, run="r1", signals=False, remote=s3_url) as mgr:
        assert mgr.tier is not None
        mgr.tier.retry = 0.2
        first = _first_drain(mgr)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        for step in range(2, 5):
            mgr.save(step, _weights(step)).result()
        deadline = time.monotonic() + 60
        while mgr.tier.wait(5).saves and time.monotonic() < deadline:
            pass  # the first cycle after the kill fails; a retry starts a new worker
        assert mgr.tier.lag().saves == 0
        second = _worker(mgr)._process
        assert second is not None and second.pid != first.pid
    remote = cas.open(s3_url)
    for step in range(1, 5):
        ref = f"runs/r1/phase1/ckpt_phase1_step{step:08d}"
        assert remote.resolve(ref) == local.resolve(ref)
    assert remote.resolve("runs/r1/latest") == local.resolve("runs/r1/latest")


def _train_and_report_worker(local: str, remote: str, pid_file: str) -> None:
    repo = cas.open(local)
    mgr = CheckpointManager(repo, run="r1", signals=False, remote=remote)
    for step in itertools.count(1):
        mgr.save(step, _weights(step)).result()
        assert mgr.tier is not None
        mgr.tier.wait(60)
        process = _worker(mgr)._process
        if process is not None:
            Path(pid_file).write_text(str(process.pid))
        threading.Event().wait(0.05)


def test_the_worker_exits_when_the_training_process_is_killed(s3_url: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    run = multiprocessing.get_context("fork").Process(
        target=_train_and_report_worker,
        args=(str(tmp_path / "local"), s3_url, str(pid_file)),
    )
    run.start()
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid_file.exists(), "the run drained nothing within a minute"
    worker = int(pid_file.read_text())
    os.kill(run.pid or 0, signal.SIGKILL)
    run.join(10)
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the drain worker outlived its training process"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_worker_ignores_ctrl_c_and_sigterm_sent_to_the_whole_job(
    s3_url: str, tmp_path: Path
) -> None:
    local = cas.open(tmp_path / "local")
    with CheckpointManager(local, run="r1", signals=False, remote=s3_url) as mgr:
        assert mgr.tier is not None
        worker = _first_drain(mgr)
        for sent in (signal.SIGINT, signal.SIGTERM):
            os.kill(worker.pid, sent)
        mgr.save(2, _weights(2)).result()
        assert mgr.tier.wait(60).saves == 0
        assert _worker(mgr)._process is worker and worker.poll() is None  # the same worker
    assert cas.open(s3_url).resolve("runs/r1/latest") == local.resolve("runs/r1/latest")


def test_a_process_forked_from_training_does_not_keep_the_worker_alive(
    s3_url: str, tmp_path: Path
) -> None:
    """A data loader's forked workers inherit the pipe to the drain worker; they close it, so
    the worker still ends when the training process closes its end."""
    local = cas.open(tmp_path / "local")
    mgr = CheckpointManager(local, run="r1", signals=False, remote=s3_url)
    worker = _first_drain(mgr)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    try:
        began = time.monotonic()
        mgr.close()
        assert worker.poll() is not None
        assert time.monotonic() - began < 10  # not the 30 s close waits before it kills
        assert worker.returncode == 0  # it saw the pipe close and returned
    finally:
        child.kill()
        child.join()
