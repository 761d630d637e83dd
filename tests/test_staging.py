"""The staging pool: a save's private copies reuse a bounded set of buffers across saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import cas
from cas.errors import CASError
from cas.objects import staging
from cas.objects.chunkio import WORKERS
from cas.objects.private import PAYLOAD_OFFSET, is_private
from cas.objects.staging import CPU_SLOTS, StagingPool, pool_limit
from tests.helpers import ref_chunk_paths

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def tensors(count: int, seed: int, mib: int = 2) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(mib * MiB // 4, generator=gen) for i in range(count)}


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the buffers the pool maps from here on, one entry per mapping."""
    sizes: list[int] = []
    real = staging._mapping

    def mapping(size: int) -> object:
        sizes.append(size)
        return real(size)

    monkeypatch.setattr(staging, "_mapping", mapping)
    return sizes


def test_leases_are_private_page_laid_out_and_reused(made: list[int]) -> None:
    pool = StagingPool(8 * MiB)
    for _ in range(5):
        with pool.lease(3 * MiB) as staged:
            assert is_private(memoryview(staged)) and staged.nbytes == 3 * MiB
            assert staged.ctypes.data % 4096 == PAYLOAD_OFFSET  # where a chunk payload lies
            staged[:] = 7
        with pool.lease(2 * MiB):  # smaller: the same buffer serves it
            pass
    assert len(made) == 1 and pool.held == made[0] <= 8 * MiB


def test_a_lease_past_the_bound_waits_for_one_to_be_returned() -> None:
    pool = StagingPool(4 * MiB)
    order: list[str] = []
    first = pool.lease(3 * MiB)
    first.__enter__()

    def second() -> None:
        with pool.lease(3 * MiB):
            order.append("second")

    waiter = threading.Thread(target=second)
    waiter.start()
    time.sleep(0.2)
    order.append("first returned")
    first.__exit__(None, None, None)
    waiter.join(5)
    assert order == ["first returned", "second"]
    assert pool.peak <= 4 * MiB


def test_a_lease_larger_than_the_pool_is_served_and_not_kept() -> None:
    pool = StagingPool(2 * MiB)
    with pool.lease(5 * MiB) as staged:
        staged[:] = 1
    assert pool.held == 0


def test_many_savers_never_hold_more_than_the_bound(tmp_path: Path) -> None:
    pool = StagingPool(6 * MiB)
    held: list[int] = []

    def worker() -> None:
        for _ in range(20):
            with pool.lease(MiB + 4096 * 3) as staged:
                held.append(pool.held)
                staged[:] = 0

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert max(held) <= 6 * MiB and pool.peak <= 6 * MiB


def test_saves_copy_into_the_process_pool_and_store_what_they_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made: list[int]
) -> None:
    leased: list[int] = []
    real_lease = StagingPool.lease

    def lease(self: StagingPool, nbytes: int) -> object:
        leased.append(nbytes)
        return real_lease(self, nbytes)

    monkeypatch.setattr(StagingPool, "lease", lease)
    repo = cas.open(tmp_path / "store")
    first = tensors(24, 1)
    repo.save(first, "runs/a")
    repo.save(tensors(24, 2), "runs/b")  # all new bytes again: the same buffers serve them
    # 48 chunks copied privately, through at most one buffer per chunk worker.
    assert leased == [2 * MiB] * 48 and len(made) <= WORKERS
    pool = staging.staging_pool()
    assert 0 < pool.held <= pool.limit
    back = repo.load("runs/a")
    assert all(bool((back[k] == v).all()) for k, v in first.items())


def test_cas_put_reads_file_chunks_into_the_pool_and_dedups_with_a_save(tmp_path: Path) -> None:
    import torch

    state = tensors(3, 3)
    torch.save(state, tmp_path / "state.pt")
    repo = cas.open(tmp_path / "store")
    repo.save(state, "runs/saved")
    leased: list[int] = []
    real = StagingPool.lease

    def counting(self: StagingPool, nbytes: int) -> object:
        leased.append(nbytes)
        return real(self, nbytes)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StagingPool, "lease", counting)
        repo.put_path(tmp_path / "state.pt", "files/state")
    assert leased == [2 * MiB] * 3  # each tensor's chunk read once, into a staging buffer
    assert set(ref_chunk_paths(repo, "runs/saved")) <= set(ref_chunk_paths(repo, "files/state"))
    repo.get_path("files/state", tmp_path / "back.pt")
    assert (tmp_path / "back.pt").read_bytes() == (tmp_path / "state.pt").read_bytes()


def test_the_bound_is_set_by_cas_staging_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAS_STAGING_POOL", "256M")
    assert pool_limit() == 256 * MiB
    monkeypatch.setenv("CAS_STAGING_POOL", "lots")
    with pytest.raises(CASError, match="CAS_STAGING_POOL='lots' is not a size"):
        pool_limit()
    with pytest.raises(CASError, match="below 1 MiB"):
        StagingPool(4096)


def test_a_bad_pool_size_is_one_line_from_the_cli(tmp_path: Path) -> None:
    import torch

    src = tmp_path / "big.pt"
    torch.save(tensors(1, 4), src)
    proc = subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(tmp_path / "s"), "put", str(src), "f/big"],
        capture_output=True,
        text=True,
        env={"PATH": "", "PYTHONPATH": str(ROOT), "CAS_STAGING_POOL": "lots"},
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "CAS_STAGING_POOL" in proc.stderr


@pytest.mark.slow
def test_a_saves_peak_memory_above_its_state_stays_within_the_pool(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_rss.py"), "cas", str(tmp_path),
         "--size-gb", "0.25"],
        capture_output=True, text=True, check=True, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    ).stdout  # fmt: skip
    report = json.loads(out.strip().splitlines()[-1])
    assert 0 < report["pool_peak"] <= report["pool_limit"]
    assert report["peak_above_state"] <= report["pool_limit"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_saves_through_a_pool_of_its_own(tmp_path: Path) -> None:
    import numpy as np

    pool = staging.staging_pool()
    held = pool.lease(2 * MiB)
    held.__enter__()  # another thread's lease, open at the fork
    cores = staging.cores()
    for _ in range(cores):
        CPU_SLOTS.__enter__()  # and every CPU slot, held by chunk workers at the fork
    try:
        pid = os.fork()
        if pid == 0:  # the child: a new pool, and a save that does not wait on the parent's
            import signal

            signal.alarm(60)  # a child stuck on the parent's slots dies instead of hanging
            # numpy, not torch ops: torch's thread pool does not survive a fork
            ok = staging.staging_pool() is not pool
            repo = cas.open(tmp_path / "child")
            repo.save({"w": np.ones(1 << 20, dtype=np.float32)}, "runs/child")
            os._exit(0 if ok and repo.load("runs/child")["w"].sum() == 1 << 20 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        for _ in range(cores):
            CPU_SLOTS.__exit__()
        held.__exit__(None, None, None)


def _thp_eligible(address: int) -> str | None:
    """``THPeligible`` of the mapping that holds ``address`` (``/proc/self/smaps``), or None
    where this kernel offers no huge pages to ask for."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    smaps = Path("/proc/self/smaps")
    if not (thp.exists() and smaps.exists()) or "[never]" in thp.read_text():
        return None
    eligible = None
    inside = False
    for block in smaps.read_text().split("\n")[:-1]:
        if "-" in block.split(" ", 1)[0] and not block.startswith(("THP", " ")):
            low, high = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
            inside = low <= address < high
        elif inside and block.startswith("THPeligible:"):
            eligible = block.split()[1]
    return eligible


def test_pool_buffers_start_on_a_huge_page_boundary_and_ask_for_huge_pages() -> None:
    pool = StagingPool(16 * MiB)
    with pool.lease(4 * MiB) as staged:
        start = staged.ctypes.data - PAYLOAD_OFFSET
        assert start % (2 * MiB) == 0
        # None: no huge pages here to ask for, and the alignment is all there is to see.
        # "1": MADV_HUGEPAGE took, and the kernel may back the buffer with 2 MiB pages.
        assert _thp_eligible(start) in (None, "1")


def test_a_load_reads_into_plain_memory_not_advised_for_huge_pages(tmp_path: Path) -> None:
    """A process's first load faults its tensors in fresh: in huge pages that took twice as
    long on a VM whose host takes back free memory (docs/design.md), so loads do not ask."""
    if "[madvise]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        pytest.skip("only with THP in madvise mode does the advice show in smaps")
    repo = cas.open(tmp_path / "store")
    repo.save({"w": torch.ones(8 << 20)}, "runs/r")
    loaded = repo.load("runs/r")["w"]
    assert loaded.sum().item() == 8 << 20
    middle = loaded.data_ptr() + loaded.nbytes // 2  # past any unaligned head of the buffer
    assert _thp_eligible(middle) == "0"


def test_a_save_copies_and_hashes_no_more_chunks_at_once_than_there_are_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cas.objects import store

    running = 0
    most = 0
    lock = threading.Lock()

    def watched(real: Any) -> Any:
        def call(*args: Any) -> Any:
            nonlocal running, most
            if not is_private(args[0]):
                return real(*args)  # a re-save's probe where the bytes lie: no disk to wait on
            with lock:
                running += 1
                most = max(most, running)
            try:
                time.sleep(0.005)  # long enough for every free worker to arrive meanwhile
                return real(*args)
            finally:
                with lock:
                    running -= 1

        return call

    from cas.digest import digest_of
    from cas.objects.private import copy_into

    monkeypatch.setattr(store, "copy_into", watched(copy_into))
    monkeypatch.setattr(store, "digest_of", watched(digest_of))
    repo = cas.open(tmp_path / "store")
    state = tensors(32, 3)
    repo.save(state, "runs/a")
    assert repo.io.workers == WORKERS > staging.cores()
    assert 1 <= most <= staging.cores()
    back = repo.load("runs/a")
    assert all(bool((back[k] == v).all()) for k, v in state.items())


def test_a_managers_staging_tensors_are_plain_memory_not_advised_for_huge_pages() -> None:
    """A run's first save faults its staging set in while the loop waits: in huge pages that
    took four to six times as long here (docs/design.md), so staging tensors do not ask."""
    from cas.training.async_save import staging_tensor

    if "[madvise]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        pytest.skip("only with THP in madvise mode does the advice show in smaps")
    staged = staging_tensor(torch.Size([8 << 20]), torch.float32)
    staged.fill_(1.0)
    assert _thp_eligible(staged.data_ptr() + staged.nbytes // 2) == "0"
