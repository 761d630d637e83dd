"""``cas mount``: any program reads checkpoints in place through a read-only FUSE mount."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import cas
from cas.fs.fuse import fuse_unavailable_reason
from cas.objects.store import chunk_key
from tests.helpers import local_root, trained_state
from tests.prerequisites import require


@pytest.fixture(autouse=True)
def fuse_works() -> None:
    """Every test here mounts a store."""
    reason = fuse_unavailable_reason()
    require(f"FUSE unusable here: {reason}" if reason else None)


def _wait_for_mount(
    mountpoint: Path, process: subprocess.Popen[bytes], timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.ismount(mountpoint):
            return
        if process.poll() is not None:
            raise AssertionError(
                f"cas mount exited: {process.stderr.read().decode() if process.stderr else ''}"
            )
        time.sleep(0.05)
    raise AssertionError("cas mount did not come up")


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[cas.Repository, Path, Path]]:
    """A store with an ingested HF-style checkpoint and a saved state, mounted at ``mnt``."""
    store = tmp_path / "store"
    repo = cas.open(store)
    ckpt = tmp_path / "checkpoint-500"
    ckpt.mkdir()
    torch.manual_seed(0)
    save_file({"w": torch.randn(512, 1024), "b": torch.randn(1024)}, ckpt / "model.safetensors")
    torch.save({"opt": torch.randn(1000)}, ckpt / "optimizer.pt")
    # Many chunks, so readahead near the start of the file never reaches the last one.
    (ckpt / "data.bin").write_bytes(os.urandom(16 << 20))
    repo.put_path(ckpt, "runs/r1/checkpoint-500")
    repo.save(trained_state(), "runs/r1/state-3")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from cas.cli import main; main()",
            "--store",
            str(store),
            "mount",
            "runs/r1",
            str(mnt),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_for_mount(mnt, process)
        yield repo, ckpt, mnt
    finally:
        subprocess.run(["fusermount", "-u", str(mnt)], check=False, capture_output=True)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        repo.close()


def test_sha256sum_reads_ingested_files_byte_identical(
    mounted: tuple[cas.Repository, Path, Path],
) -> None:
    _, ckpt, mnt = mounted
    assert sorted(os.listdir(mnt)) == ["checkpoint-500", "state-3"]
    assert sorted(os.listdir(mnt / "checkpoint-500")) == [
        "data.bin",
        "model.safetensors",
        "optimizer.pt",
    ]
    for name in ("model.safetensors", "optimizer.pt", "data.bin"):
        result = subprocess.run(
            ["sha256sum", str(mnt / "checkpoint-500" / name)], capture_output=True, check=True
        )
        expected = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
        assert result.stdout.decode().split()[0] == expected, name
        assert (mnt / "checkpoint-500" / name).stat().st_size == (ckpt / name).stat().st_size
    loaded = torch.load(mnt / "checkpoint-500" / "optimizer.pt", weights_only=True)
    assert torch.equal(loaded["opt"], torch.load(ckpt / "optimizer.pt", weights_only=True)["opt"])


def test_a_saved_state_opens_with_safe_open_and_torch_load_in_place(
    mounted: tuple[cas.Repository, Path, Path],
) -> None:
    repo, _, mnt = mounted
    state = repo.load("runs/r1/state-3")
    with safe_open(str(mnt / "state-3" / "model.safetensors"), framework="pt") as f:
        for key, tensor in state["model"].items():
            assert torch.equal(f.get_tensor(key), tensor)
    assert (mnt / "state-3" / "manifest.json").read_text().startswith("{")
    optimizer = torch.load(mnt / "state-3" / "optimizer.pt", weights_only=True, mmap=True)
    assert torch.equal(optimizer["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert optimizer["param_groups"] == state["optimizer"]["param_groups"]


def test_the_mount_is_read_only(mounted: tuple[cas.Repository, Path, Path]) -> None:
    _, _, mnt = mounted
    with pytest.raises(OSError) as excinfo:
        (mnt / "checkpoint-500" / "new.bin").write_bytes(b"x")
    assert excinfo.value.errno in (errno.EROFS, errno.EACCES)


def test_a_corrupted_chunk_is_eio_for_the_reader(
    mounted: tuple[cas.Repository, Path, Path],
) -> None:
    repo, _, mnt = mounted
    entry = repo.manifest("runs/r1/checkpoint-500").files["data.bin"]
    victim = local_root(repo) / chunk_key(entry.chunks[-1].digest)
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with open(mnt / "checkpoint-500" / "data.bin", "rb", buffering=0) as f:
        head = f.read(entry.chunks[0].size)  # untouched chunks still read
        assert len(head) == entry.chunks[0].size
        with pytest.raises(OSError) as excinfo:
            f.seek(entry.size - 10)
            f.read(10)
    assert excinfo.value.errno == errno.EIO
