"""Shared test helpers: small stores, training states and byte-exact comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import cas
from cas.repo.config import StoreConfig


def small_chunk_repo(root: Path, chunk_size: int = 64 << 10, **kw: Any) -> cas.Repository:
    """A local store with small chunks so small tensors still span several chunks."""
    return cas.open(root, config=StoreConfig(chunk_size=chunk_size, inline_max=256, **kw))


def uncache(path: Path) -> None:
    """Write ``path`` out and drop its pages from the page cache, as memory pressure would."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def chunk_files(repo: cas.Repository) -> set[str]:
    """Keys of every stored chunk."""
    return set(repo.blobs.list("chunks/"))


def ref_chunk_paths(repo: cas.Repository, ref: str) -> list[Path]:
    """The file of every chunk the checkpoint ``ref`` names, in manifest order (a local store)."""
    from cas.objects.store import chunk_key

    return [
        local_root(repo) / chunk_key(c.digest) for t in repo.manifest(ref).tensors for c in t.chunks
    ]


def stored_bytes(repo: cas.Repository) -> int:
    """Bytes of every chunk file in the store."""
    return sum(info.size for info in repo.blobs.list_info("chunks/"))


def trained_state(steps: int = 3, seed: int = 0, width: int = 64) -> dict[str, Any]:
    """A real model + AdamW state after ``steps`` optimizer steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width * 2), torch.nn.GELU(), torch.nn.Linear(width * 2, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    for _ in range(steps):
        loss = model(torch.randn(16, width)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng_state": torch.get_rng_state(),
        "step": steps,
    }


def assert_bit_exact(a: Any, b: Any, path: str = "") -> None:
    """Structures equal, tensors equal byte for byte with the same dtype and shape."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        ab = a.detach().contiguous().reshape(-1).view(torch.uint8) if a.numel() else a
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8) if b.numel() else b
        assert torch.equal(ab, bb), f"bytes differ at {path}"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), path
        for key in a:
            assert_bit_exact(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_bit_exact(x, y, f"{path}.{i}")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, path
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def local_root(repo: cas.Repository) -> Path:
    """The directory of a local store."""
    root = repo.blobs.local_root
    assert root is not None
    return root


def run_cli(
    store: Path, *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``cas --store STORE ARGS`` in a subprocess, as a user runs it; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(store), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )
