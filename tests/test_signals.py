"""Signals and kills against a real training process (tests/train_script.py in a subprocess)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cas

SCRIPT = Path(__file__).with_name("train_script.py")


class Trainer:
    """One run of the training script, read line by line."""

    def __init__(self, store: Path, run: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--store", str(store), "--run", run, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.strip())
            if line.strip() == text:
                return
        raise AssertionError(f"never printed {text!r}; got {self.lines}; stderr: {self.stderr()}")

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None
        return self.proc.stderr.read()

    def finish(self, timeout: float = 120.0) -> int:
        out, err = self.proc.communicate(timeout=timeout)
        self.lines.extend(line.strip() for line in out.splitlines())
        self.err = err
        return self.proc.returncode


def run_to_end(store: Path, run: str, *args: str) -> Trainer:
    trainer = Trainer(store, run, *args)
    code = trainer.finish()
    assert code == 0, trainer.err
    return trainer


def final_checkpoint(store: Path, run: str) -> tuple[Any, dict[str, Any]]:
    with cas.open(store) as repo:
        return repo.load(f"runs/{run}/latest"), repo.show(f"runs/{run}/latest")["meta"]


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_identical(a: Any, b: Any, path: str = "") -> None:
    """Same structure, same values, tensors and arrays equal byte for byte."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert tensor_bytes(a) == tensor_bytes(b), f"{path} differs"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.tobytes() == b.tobytes(), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys differ"
        for key in a:
            assert_bit_identical(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_identical(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.slow
def test_sigterm_then_resume_is_bit_identical_to_a_run_that_never_stopped(tmp_path: Path) -> None:
    store = tmp_path / "store"
    run_to_end(store, "straight", "--steps", "16")

    stopped = Trainer(store, "stopped", "--steps", "16", "--sleep", "0.1")
    stopped.wait_for("step 7")
    stopped.proc.send_signal(signal.SIGTERM)
    assert stopped.finish() == 0, stopped.err
    _, meta = final_checkpoint(store, "stopped")
    assert meta["status"] == "interrupted" and meta["trigger"] == "signal"
    interrupted_at = meta["step"]
    assert 7 <= interrupted_at < 16
    assert f"step {interrupted_at + 1}" not in stopped.lines

    resumed = run_to_end(store, "stopped", "--steps", "16")
    assert any(line.startswith(f"resumed {interrupted_at} ") for line in resumed.lines)

    straight_tree, straight_meta = final_checkpoint(store, "straight")
    resumed_tree, resumed_meta = final_checkpoint(store, "stopped")
    assert straight_meta["status"] == resumed_meta["status"] == "completed"
    assert_bit_identical(straight_tree["state"], resumed_tree["state"])
    assert_bit_identical(straight_tree["rng"], resumed_tree["rng"])
    assert straight_meta["metrics"] == resumed_meta["metrics"]

    with cas.open(store) as repo:
        from cas.training.history import TrainingHistory

        losses = {
            r["step"]: r["loss"]
            for r in TrainingHistory(repo, "runs/stopped/history").read()
            if "loss" in r
        }
        straight = {
            r["step"]: r["loss"]
            for r in TrainingHistory(repo, "runs/straight/history").read()
            if "loss" in r
        }
    assert losses == straight and sorted(losses) == list(range(1, 17))


def test_sigusr1_saves_and_training_goes_on(tmp_path: Path) -> None:
    store = tmp_path / "store"
    trainer = Trainer(store, "usr1", "--steps", "12", "--every", "100", "--sleep", "0.1")
    trainer.wait_for("step 4")
    trainer.proc.send_signal(signal.SIGUSR1)
    assert trainer.finish() == 0, trainer.err
    assert "done" in trainer.lines
    with cas.open(store) as repo:
        saves = [
            repo.show(r.name)["meta"] for r in repo.refs("runs/usr1/phase1/") if "ckpt_" in r.name
        ]
    by_trigger = {m["trigger"]: m for m in saves}
    assert by_trigger["signal"]["status"] == "running"
    assert 4 <= by_trigger["signal"]["step"] < 12
    assert by_trigger["final"]["step"] == 12 and by_trigger["final"]["status"] == "completed"


def test_sigkill_during_async_save_leaves_previous_checkpoint_as_latest(tmp_path: Path) -> None:
    store = tmp_path / "store"
    trainer = Trainer(store, "killed", "--steps", "20", "--every", "5", "--slow-after", "5")
    trainer.wait_for("saving 10")
    time.sleep(0.3)
    os.kill(trainer.proc.pid, signal.SIGKILL)
    trainer.finish()
    with cas.open(store) as repo:
        latest = repo.show("runs/killed/latest")["meta"]
        assert latest["step"] == 5
        assert not repo.refs("runs/killed/phase1/ckpt_phase1_step00000010")
        state = repo.load("runs/killed/latest")["state"]
        assert set(state) == {"model", "optimizer", "scheduler"}
        report = repo.verify(["runs/killed/"], level="full")
        assert report.ok, report.problems

    resumed = run_to_end(store, "killed", "--steps", "8")
    assert "resumed 5 from runs/killed/phase1/ckpt_phase1_step00000005" in resumed.lines


def test_corrupted_latest_falls_back_to_the_previous_checkpoint_and_says_so(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    run_to_end(store, "flaky", "--steps", "10", "--every", "5", "--sync")
    with cas.open(store) as repo:
        manifest = repo.manifest("runs/flaky/latest")
        chunk = next(c.digest for t in manifest.tensors for c in t.chunks)
    chunk_file = store / "chunks" / chunk[:2] / chunk
    data = bytearray(chunk_file.read_bytes())
    data[-1] ^= 0x01
    chunk_file.write_bytes(bytes(data))

    resumed = run_to_end(store, "flaky", "--steps", "12", "--every", "5", "--sync")
    assert "skipped runs/flaky/phase1/ckpt_phase1_step00000010" in resumed.lines
    assert "resumed 5 from runs/flaky/phase1/ckpt_phase1_step00000005" in resumed.lines
    assert "failed verification" in resumed.err


def test_handlers_detached_off_the_main_thread_pass_signals_on(tmp_path: Path) -> None:
    from cas.training.signals import SignalTriggers

    seen: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: seen.append(signum)) for s in
              (signal.SIGTERM, signal.SIGUSR1)}  # fmt: skip
    try:
        triggers = SignalTriggers()
        assert triggers.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert triggers.take_save_request() and seen == []
        closer = threading.Thread(target=triggers.uninstall)  # e.g. close() from another thread
        closer.start()
        closer.join()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGTERM, signal.SIGUSR1]
        assert not triggers.stop_requested and not triggers.take_save_request()
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_finish_gives_the_signals_back(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    mgr = cas.CheckpointManager(cas.open(tmp_path / "store"), run="r1")
    assert signal.getsignal(signal.SIGTERM) != previous
    mgr.finish(1, {"w": torch.ones(2)})
    assert signal.getsignal(signal.SIGTERM) == previous
    mgr.close()
