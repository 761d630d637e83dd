"""CheckpointManager in-process: layout, latest/best, gates, resume modes, async saves, history."""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

import cas
from cas.blobstore import LocalBlobStore, Payload
from cas.errors import NotFound
from cas.refs.log import TAIL_BYTES
from cas.repo.config import StoreConfig
from cas.retention.policy import RetentionPolicy, Rule
from cas.training.async_save import AsyncSaveError, AsyncWriter
from cas.training.history import TrainingHistory
from cas.training.manager import (
    CheckpointManager,
    ConfigMismatch,
    StrictLoadError,
    config_hash,
    new_run_id,
)
from tests.helpers import local_root


def make_model(seed: int = 0, out: int = 4) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, out))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def corrupt_first_chunk(repo: cas.Repository, ref: str) -> None:
    """Flip the last byte of the first chunk file of ``ref``."""
    digest = next(c.digest for t in repo.manifest(ref).tensors for c in t.chunks)
    path = local_root(repo) / f"chunks/{digest[:2]}/{digest}"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def repo(tmp_path: Path) -> cas.Repository:
    return cas.open(tmp_path / "store", config=StoreConfig(chunk_size=16 << 10))


def manager(repo: cas.Repository, **kw: Any) -> CheckpointManager:
    kw.setdefault("run", "r1")
    kw.setdefault("signals", False)
    return CheckpointManager(repo, **kw)


def test_run_id_encodes_start_time_and_seed() -> None:
    run = new_run_id(0xA1B2C3D4, clock=lambda: 1768487422.0)
    assert run == "20260115_143022_a1b2c3d4"


def test_periodic_saves_follow_the_hydra_layout_with_latest_and_best(repo: cas.Repository) -> None:
    model, opt = make_model()
    losses = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0]
    with manager(repo, every_n_steps=10, best=("loss", "min"), phase=2) as mgr:
        for step in range(1, 61):
            train_step(model, opt)
            mgr.step_end(step, lambda: state_of(model, opt), {"loss": losses[(step - 1) // 10]})
        assert mgr.latest() == "runs/r1/phase2/ckpt_phase2_step00000060"
        assert mgr.best_checkpoint() == "runs/r1/phase2/ckpt_phase2_step00000040"
    names = sorted(r.name for r in repo.refs("runs/r1/phase2/"))
    assert names == ["runs/r1/phase2/best"] + [
        f"runs/r1/phase2/ckpt_phase2_step{s:08d}" for s in range(10, 61, 10)
    ]
    meta = repo.show("runs/r1/latest")["meta"]
    assert (meta["step"], meta["phase"], meta["status"], meta["trigger"]) == (
        60, 2, "running", "periodic"
    )  # fmt: skip
    assert [e.message for e in reversed(repo.log("runs/r1/latest"))] == [
        f"runs/r1/phase2/ckpt_phase2_step{s:08d}" for s in range(10, 61, 10)
    ]


def test_best_by_max_ignores_missing_and_nan_metrics(repo: cas.Repository) -> None:
    model, opt = make_model()
    with manager(repo, best=("rating", "max")) as mgr:
        mgr.save(1, state_of(model, opt), {"rating": 10.0})
        mgr.save(2, state_of(model, opt), {"rating": float("nan")})
        mgr.save(3, state_of(model, opt), {})
        mgr.save(4, state_of(model, opt), {"rating": 12.5})
        mgr.save(5, state_of(model, opt), {"rating": 11.0})
        assert mgr.best_checkpoint() == "runs/r1/phase1/ckpt_phase1_step00000004"


def test_async_save_keeps_the_state_as_it_was_when_save_returned(repo: cas.Repository) -> None:
    model, opt = make_model()
    train_step(model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with manager(repo) as mgr:
        pending = mgr.save(1, state_of(model, opt))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the loop goes on while the save is written
        result = pending.result()
    loaded = repo.load(result.ref)["state"]["model"]
    for key, value in expected.items():
        assert torch.equal(loaded[key], value)
    assert result.blocking_seconds < 5 and result.logical_bytes > 0


class Switches:
    """Fault switches, shared by a store and the handles it gives out (``for_background_writes``
    copies the store, so a plain attribute set later would reach only the original)."""

    failing = False
    delay = 0.0
    gate: threading.Event | None = None
    """While set to an unset event, chunk writes wait for it."""


class SwitchedChunks(LocalBlobStore):
    """A local store whose chunk writes obey ``switches``: fail while ``failing``, sleep ``delay``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.switches = Switches()

    def put_if_absent(self, key: str, data: Payload) -> bool:
        if key.startswith("chunks/"):
            if self.switches.failing:
                raise cas.BackendError("disk full (injected)")
            time.sleep(self.switches.delay)
            if self.switches.gate is not None:
                self.switches.gate.wait(timeout=60)
        return super().put_if_absent(key, data)


def test_a_background_failure_is_raised_at_the_next_save_and_latest_stays(tmp_path: Path) -> None:
    base = cas.open(tmp_path / "store")
    blobs = SwitchedChunks(tmp_path / "store")
    repo = cas.Repository(blobs, base.config)
    model, opt = make_model()
    mgr = manager(repo)
    first = mgr.save(1, state_of(model, opt)).result()
    train_step(model, opt)
    blobs.switches.failing = True
    doomed = mgr.save(2, state_of(model, opt))
    with pytest.raises(cas.BackendError):
        doomed.result()
    blobs.switches.failing = False
    with pytest.raises(AsyncSaveError, match="disk full"):
        mgr.save(3, state_of(model, opt))
    assert repo.resolve("runs/r1/latest") == first.digest
    mgr.save(3, state_of(model, opt)).result()
    mgr.close()
    assert repo.show("runs/r1/latest")["meta"]["step"] == 3


def test_a_failure_during_the_slot_wait_is_raised_by_the_save_that_waited() -> None:
    writer: AsyncWriter[str] = AsyncWriter(max_in_flight=1)
    release = threading.Event()

    def doomed(_: None) -> str:
        release.wait()
        raise OSError("disk full")

    writer.submit(lambda: None, doomed)
    threading.Timer(0.1, release.set).start()  # fails while the next submit waits for the slot
    written: list[str] = []

    def next_write(_: None) -> str:
        written.append("next")
        return "next"

    with pytest.raises(AsyncSaveError, match="disk full"):
        writer.submit(lambda: None, next_write)
    writer.close()
    assert written == []


@pytest.mark.parametrize("async_save", [False, True])
def test_records_of_a_failed_save_go_into_the_history_with_the_next_one(
    tmp_path: Path, async_save: bool
) -> None:
    base = cas.open(tmp_path / "store")
    blobs = SwitchedChunks(tmp_path / "store")
    repo = cas.Repository(blobs, base.config)
    model, opt = make_model()
    mgr = manager(repo, async_save=async_save)
    mgr.record(1, loss=0.9)
    mgr.record(2, loss=0.8)
    blobs.switches.failing = True
    with pytest.raises(cas.BackendError):
        mgr.save(2, state_of(model, opt)).result()
    blobs.switches.failing = False
    mgr.record(3, loss=0.7)
    try:
        mgr.save(3, state_of(model, opt))
    except AsyncSaveError:  # the async manager reports the failure once, at the next save
        mgr.save(3, state_of(model, opt))
    mgr.close()
    history = mgr.history.read()
    assert [r["loss"] for r in history if "loss" in r] == [0.9, 0.8, 0.7]
    assert [r["step"] for r in history if r.get("event") == "save"] == [3]


def test_a_retention_policy_that_cannot_run_does_not_fail_the_committed_save(
    repo: cas.Repository,
) -> None:
    def busy_policy(_: cas.Repository) -> None:
        raise cas.CASError("the maintenance lock is held")

    model, opt = make_model()
    mgr = manager(repo, policy=busy_policy)
    first = mgr.save(1, state_of(model, opt)).result()
    assert first.retention_error == "CASError: the maintenance lock is held"
    assert repo.resolve("runs/r1/latest") == first.digest
    mgr.save(2, state_of(model, opt)).result()  # nothing left over to raise
    mgr.close()


def test_a_failure_nobody_waited_for_is_raised_by_close(tmp_path: Path) -> None:
    base = cas.open(tmp_path / "store")
    blobs = SwitchedChunks(tmp_path / "store")
    repo = cas.Repository(blobs, base.config)
    model, opt = make_model()
    mgr = manager(repo)
    blobs.switches.failing = True
    mgr.save(1, state_of(model, opt))
    with pytest.raises(AsyncSaveError):
        mgr.close()


def test_back_pressure_blocks_a_save_while_the_previous_one_is_written(tmp_path: Path) -> None:
    base = cas.open(tmp_path / "store", config=StoreConfig(chunk_size=16 << 10))
    blobs = SwitchedChunks(tmp_path / "store")
    repo = cas.Repository(blobs, base.config)
    model, opt = make_model()
    train_step(model, opt)
    with manager(repo, max_in_flight=1) as mgr:
        blobs.switches.delay = 0.05
        first = mgr.save(1, state_of(model, opt))
        assert first.blocking_seconds < 0.05
        second = mgr.save(2, state_of(model, opt))
        assert first.done()
        assert second.blocking_seconds >= 0.05
        blobs.switches.delay = 0.0


class PriorityRecorder(LocalBlobStore):
    """A local store that notes the nice value of each thread that writes a chunk."""

    seen: list[int]

    def put_if_absent(self, key: str, data: Payload) -> bool:
        if key.startswith("chunks/"):
            self.seen.append(os.getpriority(os.PRIO_PROCESS, 0))  # Linux: the calling thread
        return super().put_if_absent(key, data)


@pytest.mark.skipif(sys.platform != "linux", reason="nice is per thread only on Linux")
@pytest.mark.parametrize(
    "kw, raised",
    [({}, 0), ({"background_nice": 5}, 5), ({"yield_thread": True}, 10),
     ({"yield_thread": True, "background_nice": 0}, 0)],
)  # fmt: skip
def test_background_writes_run_at_normal_priority_unless_background_nice_raises_it(
    tmp_path: Path, kw: dict[str, Any], raised: int
) -> None:
    base = cas.open(tmp_path / "store", config=StoreConfig(chunk_size=16 << 10))
    blobs = PriorityRecorder(tmp_path / "store")
    blobs.seen = []
    model, opt = make_model()
    with manager(cas.Repository(blobs, base.config), **kw) as mgr:
        mgr.save(1, state_of(model, opt)).result()
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert blobs.seen and set(blobs.seen) == {min(own + raised, 19)}


@pytest.fixture
def gated_repo(tmp_path: Path) -> Iterator[tuple[cas.Repository, threading.Event]]:
    """A store whose chunk writes wait for the event, and torch at 3 intra-op threads."""
    base = cas.open(tmp_path / "store", config=StoreConfig(chunk_size=16 << 10))
    blobs = SwitchedChunks(tmp_path / "store")
    gate = blobs.switches.gate = threading.Event()
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        yield cas.Repository(blobs, base.config), gate
    finally:
        gate.set()
        torch.set_num_threads(threads)


def test_yield_thread_runs_the_loop_on_a_thread_fewer_until_the_save_is_written(
    gated_repo: tuple[cas.Repository, threading.Event],
) -> None:
    repo, gate = gated_repo
    model, opt = make_model()
    train_step(model, opt)
    with manager(repo, yield_thread=True, every_n_steps=2) as mgr:
        assert mgr.step_end(1, lambda: state_of(model, opt)) is None
        assert torch.get_num_threads() == 3
        pending = mgr.step_end(2, lambda: state_of(model, opt))
        assert pending is not None and not pending.done()
        assert torch.get_num_threads() == 2
        assert mgr.step_end(3, lambda: state_of(model, opt)) is None
        assert torch.get_num_threads() == 2  # still being written: still lent
        gate.set()
        pending.result()
        assert torch.get_num_threads() == 2  # given back at the next step boundary, not before
        mgr.step_end(3, lambda: state_of(model, opt))
        assert torch.get_num_threads() == 3
        gate.clear()
        threading.Timer(0.1, gate.set).start()
        mgr.finish(4, state_of(model, opt))  # waits for its save, so it gives the thread back
        assert torch.get_num_threads() == 3


def test_a_lent_thread_comes_back_with_wait_and_close_unless_the_caller_changed_the_count(
    gated_repo: tuple[cas.Repository, threading.Event],
) -> None:
    repo, gate = gated_repo
    model, opt = make_model()
    mgr = manager(repo, yield_thread=True)
    mgr.save(1, state_of(model, opt))
    assert torch.get_num_threads() == 2
    gate.set()
    mgr.wait()
    assert torch.get_num_threads() == 3
    gate.clear()
    mgr.save(2, state_of(model, opt))
    torch.set_num_threads(1)  # the training code's own choice: the manager must keep it
    gate.set()
    mgr.wait()
    assert torch.get_num_threads() == 1
    torch.set_num_threads(3)
    gate.clear()
    mgr.save(3, state_of(model, opt))
    assert torch.get_num_threads() == 2
    threading.Timer(0.1, gate.set).start()
    mgr.close()
    assert torch.get_num_threads() == 3
    assert repo.show("runs/r1/latest")["meta"]["step"] == 3


@pytest.mark.parametrize("kw", [{}, {"yield_thread": True, "async_save": False}])
def test_without_yield_thread_or_async_saves_the_thread_count_never_changes(
    gated_repo: tuple[cas.Repository, threading.Event], kw: dict[str, Any]
) -> None:
    repo, gate = gated_repo
    model, opt = make_model()
    if kw.get("async_save", True):
        threading.Timer(0.2, gate.set).start()
    else:
        gate.set()
    with manager(repo, **kw) as mgr:
        pending = mgr.save(1, state_of(model, opt))
        assert torch.get_num_threads() == 3
        pending.result()


def test_resume_restores_state_rng_and_continues_the_history(repo: cas.Repository) -> None:
    model, opt = make_model()
    config = {"lr": 1e-2, "layers": [16, 32, 4]}
    with manager(repo, config=config, seed=5) as mgr:
        assert mgr.restore("auto").mode == "fresh"
        for step in range(1, 4):
            mgr.record(step, loss=train_step(model, opt))
        mgr.save(3, state_of(model, opt)).result()
    expected_draws = (torch.rand(3), np.random.rand(3), random.random())

    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    other_model, other_opt = make_model(seed=9)
    with manager(repo, config=config, seed=5) as mgr:
        restored = mgr.restore("auto")
        assert restored.mode == "resume" and restored.step == 3 and not restored.fallbacks
        other_model.load_state_dict(restored.state["model"])
        other_opt.load_state_dict(restored.state["optimizer"])
        assert torch.equal(torch.rand(3), expected_draws[0])
        assert np.array_equal(np.random.rand(3), expected_draws[1])
        assert random.random() == expected_draws[2]
        mgr.record(4, loss=train_step(other_model, other_opt))
    records = mgr.history.read()
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r.get("event") for r in records if "event" in r] == ["save", "resume"]


def test_config_change_on_resume_is_a_clear_error_and_warm_start_allows_it(
    repo: cas.Repository,
) -> None:
    model, opt = make_model()
    train_step(model, opt)
    with manager(repo, config={"lr": 1e-2, "batch": 8}) as mgr:
        mgr.save(7, state_of(model, opt)).result()
    with manager(repo, config={"lr": 3e-4, "batch": 8}) as mgr:
        with pytest.raises(ConfigMismatch, match=r"changed: lr.*warm_start"):
            mgr.restore("resume")
        restored = mgr.restore("warm_start", keys="model.*")
    assert set(restored.state) == {"model"} and restored.step == 7
    assert config_hash({"b": 1, "a": 2}) == config_hash({"a": 2, "b": 1})


def test_warm_start_draws_fresh_randomness_from_the_seed(repo: cas.Repository) -> None:
    model, opt = make_model()
    with manager(repo, seed=11) as mgr:
        mgr.save(1, state_of(model, opt)).result()
        mgr.restore("warm_start")
        first = torch.rand(4)
        mgr.restore("warm_start")
        assert torch.equal(torch.rand(4), first)
        mgr.restore("fresh")
        assert torch.equal(torch.rand(4), first)


def test_corrupted_latest_falls_back_with_a_warning_and_reports_it(
    repo: cas.Repository, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = make_model()
    with manager(repo) as mgr:
        good = mgr.save(1, state_of(model, opt)).result()
        train_step(model, opt)
        bad = mgr.save(2, state_of(model, opt)).result()
    corrupt_first_chunk(repo, bad.ref)
    with caplog.at_level(logging.WARNING, logger="cas.training.manager"), manager(repo) as mgr:
        restored = mgr.restore("resume")
    assert restored.ref == good.ref and restored.step == 1
    assert [s.ref for s in restored.fallbacks] == [bad.ref]
    assert "corrupt" in restored.fallbacks[0].reason
    assert bad.ref in caplog.text and "failed verification" in caplog.text
    with manager(repo) as mgr, pytest.raises(cas.IntegrityError):
        mgr.restore("resume", source=bad.ref)


def test_fallback_after_a_restart_from_an_older_checkpoint_stays_on_that_branch(
    repo: cas.Repository,
) -> None:
    model, opt = make_model()
    with manager(repo) as mgr:
        five = mgr.save(5, state_of(model, opt)).result()
        train_step(model, opt)
        mgr.save(10, state_of(model, opt)).result()  # the branch the run is restarted away from
    with manager(repo) as mgr:
        mgr.restore("resume", source=five.ref)
        train_step(model, opt)
        six = mgr.save(6, state_of(model, opt)).result()
    corrupt_first_chunk(repo, six.ref)
    with manager(repo) as mgr:
        restored = mgr.restore("resume")
    assert restored.step == 5 and restored.ref == five.ref
    assert [s.reason.split(":")[0] for s in restored.fallbacks][1] == f"later than {six.ref}"


def test_resume_with_nothing_saved_is_not_found_and_auto_starts_fresh(
    repo: cas.Repository,
) -> None:
    with manager(repo, run="empty") as mgr:
        with pytest.raises(NotFound, match="no checkpoint"):
            mgr.restore("resume")
        assert mgr.restore("auto").state is None


class KeepLastTwo:
    """A stand-in retention policy: keep the two newest checkpoint refs of each phase."""

    def apply(self, repo: cas.Repository) -> None:
        ckpts = sorted(r.name for r in repo.refs("runs/**/ckpt_*"))
        for name in ckpts[:-2]:
            repo.rm(name)


def test_gate_copy_survives_fifo_pruning_and_loads_strictly(repo: cas.Repository) -> None:
    model, opt = make_model()
    with manager(repo, best=("loss", "min"), policy=KeepLastTwo(), every_n_steps=1) as mgr:
        mgr.step_end(1, state_of(model, opt), {"loss": 0.1})
        mgr.promote_gate("bc_best")
        for step in range(2, 6):
            train_step(model, opt)
            mgr.step_end(step, state_of(model, opt), {"loss": 1.0 + step})
        mgr.wait()
        assert [r.name.rsplit("_", 1)[-1] for r in repo.refs("runs/r1/phase1/ckpt_*")] == [
            "step00000004", "step00000005"
        ]  # fmt: skip
        gate = mgr.load_gate(
            "bc_best", keys="model.*", template={"model": make_model()[0].state_dict()}
        )
        assert gate["model"]["0.weight"].shape == (32, 16)
        with pytest.raises(StrictLoadError) as info:
            mgr.load_gate(
                "bc_best", keys="model.*", template={"model": make_model(out=5)[0].state_dict()}
            )
        message = str(info.value)
        assert "model.2.weight" in message and "shape" in message
        extra_template = {"model": {**make_model()[0].state_dict(), "head.bias": torch.zeros(2)}}
        with pytest.raises(StrictLoadError, match=r"1 missing: model\.head\.bias"):
            mgr.load_gate("bc_best", keys="model.*", template=extra_template)
    assert repo.refs("runs/r1/gates/bc_best")


def test_phase_transition_warm_start_from_a_gate_is_strict(repo: cas.Repository) -> None:
    model, opt = make_model()
    with manager(repo, phase=1) as mgr:
        mgr.save(100, state_of(model, opt)).result()
        mgr.promote_gate("bc_best")
    with manager(repo, phase=2) as mgr:
        restored = mgr.restore(
            "warm_start", source="runs/r1/gates/bc_best", keys="model.*",
            template={"model": make_model()[0].state_dict()},
        )  # fmt: skip
        assert restored.phase == 1 and mgr.phase == 2
        renamed = {"model": {f"student.{k}": v for k, v in make_model()[0].state_dict().items()}}
        with pytest.raises(StrictLoadError, match=r"4 missing.*4 unexpected"):
            mgr.restore(
                "warm_start", source="runs/r1/gates/bc_best", keys="model.*", template=renamed
            )


def test_sigterm_in_process_saves_the_completed_step_and_marks_the_run(
    repo: cas.Repository,
) -> None:
    model, opt = make_model()
    previous = signal.getsignal(signal.SIGTERM)
    mgr = manager(repo, signals=True, exit_on_stop=False, every_n_steps=100)
    for step in range(1, 10):
        train_step(model, opt)
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step; acted on at the boundary
        pending = mgr.step_end(step, state_of(model, opt))
        if pending is not None:
            break
    assert pending is not None and pending.step == 4
    meta = repo.show("runs/r1/latest")["meta"]
    assert (meta["status"], meta["trigger"], meta["step"]) == ("interrupted", "signal", 4)
    assert signal.getsignal(signal.SIGTERM) == previous


def test_history_is_append_only_and_seals_old_records_into_shared_chunks(
    repo: cas.Repository,
) -> None:
    history = TrainingHistory(repo, "runs/h/history")
    records = [{"step": i, "loss": 1.0 / (i + 1), "note": "x" * 40} for i in range(4000)]
    for start in range(0, 4000, 250):
        history.append(records[start : start + 250])
    assert history.read() == records and len(history) == 4000
    head = repo.manifest("runs/h/history")
    sealed = list(head.files.values())
    assert sealed and len(msgpack.packb(head.meta["tail"])) <= TAIL_BYTES
    before = {c.digest for f in sealed for c in f.chunks}
    history.append([{"step": 4000, "loss": 0.0}])
    after = {c.digest for f in repo.manifest("runs/h/history").files.values() for c in f.chunks}
    assert before <= after  # sealed segments are shared by every later version


def test_concurrent_history_appends_lose_nothing(repo: cas.Repository) -> None:
    history = TrainingHistory(repo, "runs/h/history")

    def writer(offset: int) -> None:
        for i in range(10):
            history.append([{"step": offset + i}])

    threads = [threading.Thread(target=writer, args=(k * 100,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r["step"] for r in history.read()) == sorted(
        k * 100 + i for k in range(3) for i in range(10)
    )


def test_history_writers_that_build_on_their_own_last_version_lose_nothing(
    repo: cas.Repository,
) -> None:
    first = TrainingHistory(repo, "runs/h/history")
    second = TrainingHistory(repo, "runs/h/history")
    for step in range(6):
        (first if step % 3 else second).append([{"step": step}])
    assert [r["step"] for r in first.read()] == list(range(6)) and len(second) == 6
    repo.rm("runs/h/history")
    first.append([{"step": 6}])  # its last version is gone: it starts a new history
    assert [r["step"] for r in second.read()] == [6]
    second.append([{"step": 7}])
    assert [r["step"] for r in first.read()] == [6, 7] and len(first) == 2


@pytest.mark.s3
def test_saves_and_resume_work_against_real_s3_with_conditional_refs(s3_url: str) -> None:
    repo = cas.open(s3_url)
    model, opt = make_model()
    with manager(repo, every_n_steps=2, best=("loss", "min"), config={"lr": 1}) as mgr:
        for step in range(1, 7):
            loss = train_step(model, opt)
            mgr.step_end(step, lambda: state_of(model, opt), {"loss": loss})
        assert mgr.latest() == "runs/r1/phase1/ckpt_phase1_step00000006"
    with manager(repo, config={"lr": 1}) as mgr:
        restored = mgr.restore("resume")
    assert restored.step == 6
    assert torch.equal(restored.state["model"]["0.weight"], model.state_dict()["0.weight"])
    stale = manager(repo, config={"lr": 1})
    mgr2 = manager(repo, config={"lr": 1})
    mgr2.save(7, state_of(model, opt)).result()
    stale.save(8, state_of(model, opt))
    with pytest.raises(AsyncSaveError, match="latest"):
        stale.close()
    mgr2.close()


def test_a_fifo_policy_keeps_the_newest_checkpoints_and_spares_the_best_one_a_gate_copies(
    repo: cas.Repository,
) -> None:
    policy = RetentionPolicy(
        rules=(
            Rule(
                select="runs/*/phase*/ckpt_*", max_count=3,
                protect_targets_of=("runs/*/phase*/best", "runs/*/gates/*"),
            ),
        ),
        protect=("runs/*/gates/*",),
    )  # fmt: skip
    model, opt = make_model()
    losses = [3.0, 0.5, 2.0, 2.5, 2.2, 2.1, 2.4, 2.6]
    with manager(repo, best=("loss", "min"), policy=policy, every_n_steps=1) as mgr:
        for step, loss in enumerate(losses, start=1):
            train_step(model, opt)
            mgr.step_end(step, state_of(model, opt), {"loss": loss})
            if step == 2:
                mgr.wait()
                mgr.promote_gate("bc_best")
        mgr.wait()
    # Three stay: step 2 (best, and the gate's target) counts towards the three, so only the
    # two newest of the rest survive the FIFO.
    kept = [r.name.rsplit("_", 1)[-1] for r in repo.refs("runs/r1/phase1/ckpt_*")]
    assert kept == ["step00000002", "step00000007", "step00000008"]
    assert repo.resolve("runs/r1/gates/bc_best") == repo.resolve("runs/r1/phase1/best")
    best_target = repo.resolve("runs/r1/phase1/best")
    assert best_target == repo.resolve("runs/r1/phase1/ckpt_phase1_step00000002")
    assert repo.load("runs/r1/gates/bc_best", keys="state.model.*")["state"]["model"]


def test_the_cpu_copy_is_exact_for_every_layout_and_keeps_tied_tensors_tied() -> None:
    from cas.training.async_save import Stager

    tied = torch.randn(4, 4)
    state: dict[str, Any] = {
        "bf16": torch.randn(3, 4).bfloat16(),
        "flag": torch.tensor(True),
        "transposed": torch.randn(4, 3).t(),
        "conj": torch.randn(2, dtype=torch.complex64).conj(),
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "array": np.arange(6, dtype=np.int16),
        "tied": [tied, tied],
    }
    stager = Stager()
    staging = stager.acquire()
    for _ in range(2):  # the second pass reuses the staging buffers
        copy = stager.snapshot(state, staging)
        for key in ("bf16", "flag", "transposed", "conj", "empty", "scalar"):
            assert copy[key].dtype == state[key].dtype and torch.equal(
                copy[key], state[key].resolve_conj()
            ), key
        assert np.array_equal(copy["array"], state["array"])
        assert copy["tied"][0] is copy["tied"][1] and copy["tied"][0] is not tied
        state["bf16"].add_(1)


def test_a_save_commits_checkpoint_history_and_latest_under_one_writer_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cas.refs.leases import WriterLease

    acquired: list[str] = []
    real_acquire = WriterLease.acquire

    def counted(self: WriterLease) -> WriterLease:
        acquired.append(self.purpose)
        return real_acquire(self)

    monkeypatch.setattr(WriterLease, "acquire", counted)
    repo = cas.open(tmp_path / "store")
    model, opt = make_model()
    with CheckpointManager(repo, run="runs/one-lease", signals=False, best=("loss", "min")) as mgr:
        for step in (1, 2):
            loss = train_step(model, opt)
            mgr.save(step, state_of(model, opt), {"loss": loss}).result()
    assert acquired == ["checkpoint", "checkpoint"]
    assert mgr.latest() is not None and len(mgr.history) >= 2
    assert list(repo.blobs.list("leases/")) == []  # released after each save


@pytest.mark.parametrize("async_save", [True, False])
def test_a_manager_saves_and_resumes_sparse_tensors_bit_exact(
    repo: cas.Repository, async_save: bool
) -> None:
    from tests.test_roundtrip import assert_same_sparse, sparse_examples

    sparse = sparse_examples()
    with manager(repo, async_save=async_save) as mgr:
        mgr.save(10, {"embedding": sparse}).result()
        for tensor in sparse.values():  # the next step changes them in place: the save has its copy
            (tensor._values() if tensor.layout == torch.sparse_coo else tensor.values()).zero_()
    restored = manager(repo, async_save=async_save).restore("resume")
    assert restored.step == 10
    for name, tensor in sparse_examples().items():
        assert_same_sparse(restored.state["embedding"][name], tensor)


@pytest.mark.parametrize("async_save", [True, False])
def test_a_manager_refuses_a_sparse_layout_it_cannot_store_with_a_cas_error(
    repo: cas.Repository, async_save: bool
) -> None:
    csc = torch.eye(3).to_sparse_csc()
    with manager(repo, async_save=async_save) as mgr, pytest.raises(cas.FormatError, match="csc"):
        mgr.save(1, {"w": csc}).result()


def test_resume_refuses_a_checkpoint_saved_for_other_input_data(
    repo: cas.Repository, tmp_path: Path
) -> None:
    from cas.training.manager import SystemMismatch

    def stored_inputs(text: str, ref: str) -> str:
        (tmp_path / "system.yaml").write_text(text)
        return str(repo.put_path(tmp_path / "system.yaml", ref))  # the input data's digest

    model, opt = make_model()
    inputs_v1 = stored_inputs("system: 3 plants, 12 stages", "inputs/v1")
    with manager(repo, system_hash=inputs_v1) as mgr:
        mgr.save(5, state_of(model, opt)).result()
    assert repo.manifest("runs/r1/latest").meta["system_hash"] == inputs_v1

    inputs_v2 = stored_inputs("system: 4 plants, 12 stages", "inputs/v2")
    with pytest.raises(SystemMismatch, match="input data") as refused:
        manager(repo, system_hash=inputs_v2).restore("resume")
    assert isinstance(refused.value, ConfigMismatch)  # caught wherever a config change is
    assert manager(repo, system_hash=inputs_v1).restore("resume").step == 5
    told = manager(repo, system_hash=inputs_v2).restore("resume", allow_system_change=True)
    assert told.step == 5
    assert manager(repo, system_hash=inputs_v2).restore("warm_start").step == 5
    with pytest.raises(SystemMismatch, match="passes no system_hash"):
        manager(repo).restore("resume")  # a forgotten hash could hide changed inputs


def test_training_code_that_changed_its_state_layout_resumes_older_checkpoints_step_by_step(
    repo: cas.Repository,
) -> None:
    from cas.training.manager import SchemaMismatch

    weight = torch.randn(4, 4)
    # Version 1 of the training code: a flat state.
    with manager(repo) as old:  # before the code had a schema version at all
        old.save(5, {"weights": {"fc": weight}, "lr": 0.1}).result()
    with manager(repo, schema_version=1) as v1:
        v1.save(10, {"weights": {"fc": weight}, "lr": 0.05}).result()
        v1.promote_gate("bc_best")
    assert repo.manifest("runs/r1/latest").meta["schema_version"] == 1

    calls: list[str] = []

    def v1_to_v2(state: dict[str, Any]) -> dict[str, Any]:
        calls.append("1->2")
        return {"model": state["weights"], "optimizer": {"lr": state["lr"]}}

    def v2_to_v3(state: dict[str, Any]) -> dict[str, Any]:
        calls.append("2->3")
        return {**state, "ema": {k: v.clone() for k, v in state["model"].items()}}

    # Version 2 resumes the version-1 checkpoint through its migration, then saves version 2.
    template = {"model": {"fc": weight}, "optimizer": {"lr": 0.0}}
    with manager(repo, schema_version=2, migrations={1: v1_to_v2}) as v2:
        restored = v2.restore("resume", template=template)
        assert restored.step == 10 and calls == ["1->2"]
        assert torch.equal(restored.state["model"]["fc"], weight)
        assert restored.state["optimizer"] == {"lr": 0.05}
        gate = v2.load_gate("bc_best", template=template)  # a phase transition's strict load
        assert calls == ["1->2", "1->2"] and gate["optimizer"] == {"lr": 0.05}
        v2.save(20, restored.state).result()
    assert repo.manifest("runs/r1/latest").meta["schema_version"] == 2

    # Version 3 brings an unversioned checkpoint (taken as version 1) up one step at a time.
    calls.clear()
    v3 = manager(repo, schema_version=3, migrations={1: v1_to_v2, 2: v2_to_v3})
    oldest = v3.restore("warm_start", source="runs/r1/phase1/ckpt_phase1_step00000005")
    assert calls == ["1->2", "2->3"] and torch.equal(oldest.state["ema"]["fc"], weight)
    assert oldest.state["optimizer"] == {"lr": 0.1}

    # Version 1 of the code meets a checkpoint of version 2: refused in every mode, and never
    # skipped for the older version-1 checkpoint before it.
    for mode in ("resume", "warm_start", "auto"):
        with pytest.raises(SchemaMismatch, match="schema version 2, newer than this code's 1"):
            manager(repo, schema_version=1).restore(mode)
    with pytest.raises(SchemaMismatch, match="no migration from version 1 to 2"):
        manager(repo, schema_version=2).restore(
            "resume", source="runs/r1/phase1/ckpt_phase1_step00000010"
        )
    with pytest.raises(ValueError, match="manager's own"):
        manager(repo).save(30, {}, metadata={"schema_version": 9})
