"""Benchmarks: cas against torch.save, safetensors and torch.distributed.checkpoint, side by side.

Every writer is durable (fsync) and every figure comes from the same run. Sections:

- ``core``: first save, re-save with 10% of the tensors changed, and load of a ~1 GB state dict.
  Each of the three is measured for every writer in rounds whose order rotates (``interleaved``),
  so none is always the one that runs after the others have filled and freed the page cache.
- ``startup``: ``cas --version`` and ``cas ls`` against ``import torch`` in the same run, and ten
  ``cas put`` processes of ~100 MB .pt files (``scripts/bench_startup.py``).
- ``compression``, ``gc``, ``fs``, ``manager``, ``s3``: delegated to ``scripts/bench_<name>.py``
  when present (each also runs on its own).

    python scripts/bench.py [--size-gb 1.0] [--repeat 5] [--sections core,compression,...] [--quick]

Results are printed as a table and written to ``bench-results/bench.json``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench_rss  # noqa: E402

import cas  # noqa: E402

CHUNK = 4 << 20
"""cas's default chunk size: the files of the ``direct chunks`` floor."""

GB = 1 << 30


def make_state(size_gb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformer-shaped fp32 state dict of about ``size_gb`` GiB."""
    gen = torch.Generator().manual_seed(seed)
    hidden = 1024
    per_layer = (4 * hidden * hidden + 2 * hidden * 4 * hidden) * 4
    layers = max(1, round(size_gb * GB / per_layer))
    state: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            state[f"layers.{i}.attn.{name}.weight"] = torch.randn(hidden, hidden, generator=gen)
        state[f"layers.{i}.mlp.up.weight"] = torch.randn(4 * hidden, hidden, generator=gen)
        state[f"layers.{i}.mlp.down.weight"] = torch.randn(hidden, 4 * hidden, generator=gen)
        state[f"layers.{i}.norm.weight"] = torch.ones(hidden)
    return state


def fsync_path(path: Path) -> None:
    """fsync a file, or every file in a directory, and the directory itself."""
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    directory = path.parent if path.is_file() else path
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_aside(path: Path) -> None:
    """Take ``path`` (a file or a tree) out of a writer's way without deleting it: each file is
    emptied (its blocks freed) and the whole moved into ``discarded/`` beside the section's other
    scratch, all removed with the section's directory.

    Deleting would be the benchmark's cost landing on the next writer. On an ext4 without a
    journal (this project's VM), a file created within a minute of deletions in its block group
    gets an inode only after the kernel has skipped each recently deleted one
    (``recently_deleted`` in ``find_inode_bit``), under the group's lock. A writer of many files
    (cas, the ``parallel`` and ``direct chunks`` floors) paid for the files of the round before,
    and under ``perf`` that scan took 45-50% of a 1 GiB save's CPU right after its store was
    removed; a writer of one file hardly paid at all."""
    if not path.exists():
        return
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        os.truncate(file, 0)
    bin_ = path.parent / "discarded"
    bin_.mkdir(exist_ok=True)
    path.rename(bin_ / f"{path.name}-{time.monotonic_ns()}")


def evicted(path: Path) -> Callable[[], None]:
    """A setup that takes every page of ``path`` (a file, or the files under a directory) out of
    the page cache, as a reboot or another job's reads would: the load after it reads the disk."""

    def evict() -> None:
        os.sync()
        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    return evict


def touch(loaded: dict[str, Any]) -> None:
    """Read one element per 4 KiB page, so lazily mapped loads pay for their I/O like the rest."""
    for value in loaded.values():
        if isinstance(value, torch.Tensor) and value.numel():
            value.reshape(-1)[::1024].sum()


def timed(
    fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None
) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs (``setup`` runs untimed before each).

    Every run starts with no dirty pages left by the one before (``os.sync`` untimed), so a
    durable writer never pays for flushing another writer's files."""
    return interleaved({"fn": (fn, setup)}, repeat)["fn"]


def write_durably(path: Path, parts: list[memoryview], flags: int = 0) -> None:
    """Write ``parts`` to a new file at ``path`` (``flags`` added to the open) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        for part in parts:
            os.write(fd, part)
        os.fsync(fd)
    finally:
        os.close(fd)


def interleaved(
    measures: dict[str, tuple[Callable[[], object], Callable[[], object] | None]],
    repeat: int,
    rounds: dict[str, list[float]] | None = None,
    warmup: bool = False,
) -> dict[str, float]:
    """``timed`` for several writers at once: ``repeat`` rounds, each running every measure once
    (its setup untimed, then ``os.sync`` and ``gc.collect``), in an order that rotates round by
    round, so no writer is always the one measured after the others have filled and freed the
    page cache. The
    median of each; ``rounds``, if given, receives every round's times. ``warmup`` runs one
    untimed round first, so no writer's one-time costs (imports, thread pools, buffers a process
    keeps) land in a timed round: a training process saves many times. The warm-up runs in the
    first timed round's order, so each writer's first timed run comes after every other writer
    once, as each later one does. In the rotation's own order the warm-up put the writer listed
    last first, and its first timed run came after every other writer twice. cas, listed last,
    took 0.63-0.70 s in that round in four runs (2026-11-28), against 0.54-0.59 s in the others.
    The floor's slowest round was the one where ``direct chunks`` came after the others twice,
    in three of the four runs. With this order, cas's first round took 0.83, 0.61, 0.60 and
    0.60 s in the next four runs.

    The untimed ``gc.collect`` is to the interpreter what ``os.sync`` is to the disk: no writer
    pays for collecting garbage the others left. The warm-up's first uses (DCP's and
    safetensors' imports, the threads and buffers each keeps) leave the collector owing a full
    collection, and the writer whose allocations pass the threshold next pays it, whoever made
    the objects. In this process (torch, DCP and the 1 GiB state alive) a full collection took
    116 ms, and it fell inside cas's first timed save (0.695 s against 0.54-0.58 s in the rounds
    after; ``gc.callbacks`` in a scratch copy, 2026-11-28): a save submits a future per chunk and
    runs 13-17 young collections."""
    names = list(measures)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(-1 if warmup else 0, repeat):
        shift = max(round_, 0) % len(names)
        for name in names[shift:] + names[:shift]:
            fn, setup = measures[name]
            if setup is not None:
                setup()
            os.sync()
            gc.collect()
            start = time.perf_counter()
            fn()
            if round_ >= 0:
                times[name].append(time.perf_counter() - start)
    if rounds is not None:
        rounds.update(times)
    return {name: statistics.median(values) for name, values in times.items()}


def ceiling_writers(
    work: Path, state: dict[str, torch.Tensor], chunk: int = 16 << 20
) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """Plain durable writes of ``state``'s bytes, with no serialisation, hashing or metadata.

    ``one file``: the bytes in order to one file, then fsync (torch.save's shape). ``parallel``:
    ``chunk``-sized files written and fsynced by eight threads, then the directory (cas's
    shape). ``direct``: one file per thread, two threads, through ``O_DIRECT`` from an aligned
    buffer, so the page cache is out of the way (what the device takes). ``direct chunks``: 4 MiB
    files (cas's chunk size) written by twelve threads through ``O_DIRECT`` from buffers in
    transparent huge pages, each fsynced, then the directory: cas's own shape and memory, with
    no hashing, header, temp file or link (huge pages send the disk fewer, larger requests, and
    on this project's VM beat ``direct``). Each leaves nothing
    behind for the next to flush; its files are set aside untimed (``clear``, ``set_aside``).
    The fastest of these, or any save that beats them, is the floor a save's time is read
    against: the bytes have to reach the disk.
    """
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    views: list[memoryview] = []
    for tensor in state.values():
        flat: Any = tensor.contiguous().numpy()
        views.append(memoryview(flat).cast("B"))
    pieces = [v[i : i + chunk] for v in views for i in range(0, len(v), chunk)]
    total = sum(len(p) for p in pieces)
    place = work / "ceiling"

    def clear() -> None:
        set_aside(place)
        place.mkdir()

    def one_file() -> None:
        write_durably(place / "one", pieces)
        fsync_path(place)

    def parallel() -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: write_durably(place / f"{i}", [pieces[i]]), range(len(pieces))))
        fsync_path(place)

    def direct() -> None:
        def half(index: int) -> None:
            aligned = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
            aligned.write(pieces[0][:chunk])
            blocks = [memoryview(aligned)] * (total // 2 // chunk)
            try:
                write_durably(place / f"direct{index}", blocks, getattr(os, "O_DIRECT", 0))
            except OSError:  # a filesystem without O_DIRECT (tmpfs): through the page cache
                write_durably(place / f"direct{index}", blocks)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(half, range(2)))
        fsync_path(place)

    small = [v[i : i + CHUNK] for v in views for i in range(0, len(v), CHUNK)]
    buffers: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
    for _ in range(12):
        buffers.put(huge_page_buffer(CHUNK))

    def direct_chunks() -> None:
        def one(index: int) -> None:
            buffer = buffers.get()
            try:
                piece = small[index]
                size = len(piece)
                np.frombuffer(buffer, np.uint8)[:size] = np.frombuffer(piece, np.uint8)
                padded = buffer[: -(-size // 4096) * 4096]
                try:
                    write_durably(place / f"c{index}", [padded], getattr(os, "O_DIRECT", 0))
                except OSError:
                    write_durably(place / f"c{index}", [padded])
            finally:
                buffers.put(buffer)

        with ThreadPoolExecutor(12) as pool:
            list(pool.map(one, range(len(small))))
        fsync_path(place)

    writers = {
        "one file": one_file,
        "parallel": parallel,
        "direct": direct,
        "direct chunks": direct_chunks,
    }
    return {name: (write, clear) for name, write in writers.items()}


def huge_page_buffer(size: int) -> memoryview:
    """``size`` bytes on a 2 MiB boundary in transparent huge pages where the kernel gives them,
    made as cas's staging pool makes its buffers: a direct write from them reaches the disk in
    fewer, larger requests than from 4 KiB pages."""
    from cas.blobstore.direct import huge_page_region

    mapping, start = huge_page_region(size, populate=True)
    return memoryview(mapping)[start : start + size]


def resave_floor(
    work: Path,
    state: dict[str, torch.Tensor],
    changed: dict[str, torch.Tensor],
    chunk: int = 4 << 20,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The floor under a re-save: every byte of ``changed`` hashed with blake3 on two threads,
    ``chunk`` by ``chunk`` (a store has to, to learn which bytes are new without trusting the
    caller), while the changed tensors' bytes are written as ``chunk``-sized files by eight
    threads, each fsynced, then the directory. Nothing else: no copy, header or metadata."""
    from concurrent.futures import ThreadPoolExecutor

    import blake3

    def pieces(tensors: list[torch.Tensor]) -> list[memoryview]:
        flats: list[Any] = [t.contiguous().numpy() for t in tensors]
        views = [memoryview(flat).cast("B") for flat in flats]
        return [v[i : i + chunk] for v in views for i in range(0, len(v), chunk)]

    everything = pieces(list(changed.values()))
    new = pieces([t for name, t in changed.items() if t is not state[name]])
    place = work / "resave-floor"

    def clear() -> None:
        set_aside(place)
        place.mkdir()

    def resave() -> None:
        with ThreadPoolExecutor(8) as writers, ThreadPoolExecutor(2) as hashers:
            written = writers.map(
                lambda i: write_durably(place / str(i), [new[i]]), range(len(new))
            )
            list(hashers.map(lambda piece: blake3.blake3(piece).digest(), everything))
            list(written)
        fsync_path(place)

    return resave, clear


def save_runs(rounds: dict[str, list[float]], ceilings: list[str]) -> list[dict[str, Any]]:
    """Each round's first saves as ratios: cas to that round's fastest plain write (the floor)
    and to every peer, and whether the round met the target (<= 1.2x the floor, faster than
    every peer)."""
    runs = []
    for index in range(len(rounds["cas"])):
        cas_s = rounds["cas"][index]
        floor = min(rounds[name][index] for name in ceilings)
        peers = {name: rounds[name][index] for name in ("safetensors", "torch.save", "dcp")}
        ratios = {f"cas_vs_{name}": cas_s / secs for name, secs in peers.items()}
        runs.append(
            {
                "cas_s": cas_s,
                "floor_s": floor,
                "cas_vs_floor": cas_s / floor,
                **ratios,
                "met": cas_s <= 1.2 * floor and all(r < 1 for r in ratios.values()),
            }
        )
    return runs


def bench_core(work: Path, size_gb: float, repeat: int) -> dict[str, Any]:
    """Durable save, 10%-changed re-save and load for every peer and for cas."""
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

    state = make_state(size_gb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    changed = dict(state)
    big = [n for n in state if state[n].numel() > 1 << 16]
    for name in big[::10]:
        changed[name] = state[name] + 1
    changed_bytes = sum(changed[n].numel() * 4 for n in changed if changed[n] is not state[n])
    results: dict[str, Any] = {
        "state_bytes": nbytes,
        "tensors": len(state),
        "changed_bytes": changed_bytes,
    }

    def reset(path: Path) -> Callable[[], None]:
        return lambda: set_aside(path)

    pt = work / "state.pt"

    def torch_save(sd: dict[str, torch.Tensor] = state) -> None:
        torch.save(sd, pt)
        fsync_path(pt)

    st = work / "state.safetensors"

    def st_save(sd: dict[str, torch.Tensor] = state) -> None:
        save_file(sd, st)
        fsync_path(st)

    dcp_dir = work / "dcp"

    def dcp_save(sd: dict[str, torch.Tensor] = state) -> None:
        state_dict_saver.save(sd, checkpoint_id=str(dcp_dir))
        fsync_path(dcp_dir)

    store_dir = work / "store"
    counter = iter(range(10**6))

    def cas_save() -> None:
        repo = cas.open(store_dir)
        repo.save(state, f"bench/first{next(counter)}")
        repo.close()

    def cas_resave() -> None:
        repo = cas.open(store_dir)
        repo.save(changed, f"bench/resave{next(counter)}")
        repo.close()

    def cas_store_with_state() -> None:
        reset(store_dir)()
        repo = cas.open(store_dir)
        repo.save(state, "bench/base")
        repo.close()

    target = {k: torch.empty_like(v) for k, v in state.items()}
    cas_target = {k: torch.empty_like(v) for k, v in state.items()}  # in place, as DCP loads

    def dcp_load() -> None:
        state_dict_loader.load(target, checkpoint_id=str(dcp_dir))
        touch(target)

    # Three phases, each interleaved round by round: first saves (with the plain writes the
    # disk allows), re-saves (with their floor), then warm loads of what is on disk.
    ceiling = {f"ceiling:{name}": pair for name, pair in ceiling_writers(work, state).items()}
    save_rounds: dict[str, list[float]] = {}
    saves = interleaved(
        {
            **ceiling,
            "torch.save": (torch_save, reset(pt)),
            "safetensors": (st_save, reset(st)),
            "dcp": (dcp_save, reset(dcp_dir)),
            "cas": (cas_save, reset(store_dir)),
        },
        repeat,
        save_rounds,
        warmup=True,
    )
    set_aside(work / "ceiling")
    results["save_runs"] = save_runs(save_rounds, list(ceiling))
    results["ceiling_s"] = {name.split(":", 1)[1]: saves[name] for name in ceiling}
    floor_resave, floor_clear = resave_floor(work, state, changed)
    resave_rounds: dict[str, list[float]] = {}
    resaves = interleaved(
        {
            "floor": (floor_resave, floor_clear),
            "torch.save": (lambda: torch_save(changed), None),
            "safetensors": (lambda: st_save(changed), None),
            "dcp": (lambda: dcp_save(changed), reset(dcp_dir)),
            "cas": (cas_resave, cas_store_with_state),
        },
        repeat,
        resave_rounds,
        warmup=True,
    )
    set_aside(work / "resave-floor")
    results["resave_floor_s"] = resaves["floor"]
    results["resave_rounds_s"] = resave_rounds  # round by round: the order rotates
    torch_save()  # the file cas put ingests, as a cron job would
    put_dir = work / "put-store"

    def cas_put() -> None:
        repo = cas.open(put_dir)
        repo.put_path(pt, f"bench/put{next(counter)}")
        repo.close()

    results["put_pt_s"] = timed(cas_put, repeat, reset(put_dir))
    reset(put_dir)()
    repo = cas.open(store_dir)  # holds bench/base from the last re-save's setup
    load_rounds: dict[str, list[float]] = {}
    loads = interleaved(
        {
            "torch.save": (lambda: touch(torch.load(pt, weights_only=True)), None),
            "safetensors": (lambda: touch(load_file(st)), None),
            "dcp": (dcp_load, None),
            "cas": (lambda: touch(repo.load("bench/base")), None),
            "cas mmap": (lambda: touch(repo.load("bench/base", mmap=True)), None),
            "cas load_into": (lambda: touch(repo.load_into("bench/base", cas_target)), None),
        },
        repeat,
        load_rounds,
    )
    # The first load reads what the saves just wrote: cas's chunks went past the page cache.
    results["first_load_s"] = {name: times[0] for name, times in load_rounds.items()}
    # Cold loads: every writer's files out of the page cache first (a resume on a rebooted node).
    cold_rounds: dict[str, list[float]] = {}
    results["cold_load_s"] = interleaved(
        {
            "torch.save": (lambda: touch(torch.load(pt, weights_only=True)), evicted(pt)),
            "safetensors": (lambda: touch(load_file(st)), evicted(st)),
            "dcp": (dcp_load, evicted(dcp_dir)),
            "cas": (lambda: touch(repo.load("bench/base")), evicted(store_dir)),
        },
        repeat,
        cold_rounds,
    )
    results["cold_load_rounds_s"] = cold_rounds
    results["peak_rss"] = {
        name: bench_rss.measure(name, work, size_gb) for name in bench_rss.WRITERS
    }
    check = repo.load("bench/base")
    assert all(torch.equal(check[k], v) for k, v in state.items()), "cas load is not bit-exact"
    repo.close()
    rows: dict[str, dict[str, float]] = {
        name: {"save": saves[name], "resave10": resaves[name], "load": loads[name]}
        for name in ("torch.save", "safetensors", "dcp", "cas")
    }
    rows["cas"]["load_mmap"] = loads["cas mmap"]
    rows["cas"]["load_into"] = loads["cas load_into"]
    ceilings = results["ceiling_s"]
    for row in rows.values():
        row["save_gbps"] = nbytes / GB / row["save"]
        row["load_gbps"] = nbytes / GB / row["load"]
    base = rows["torch.save"]
    results["rows"] = rows
    floor = min(*ceilings.values(), rows["cas"]["save"])
    results["ceiling"] = {
        "torch_save_vs_floor": base["save"] / floor,
        "cas_save_vs_floor": rows["cas"]["save"] / floor,
        "best_reachable_vs_torch_save": base["save"] / floor,
        "resave_floor_vs_torch_save": results["resave_floor_s"] / base["save"],
        "cas_resave_vs_floor": rows["cas"]["resave10"] / results["resave_floor_s"],
        "cas_put_vs_floor": results["put_pt_s"] / floor,
    }
    results["targets"] = {
        "first_save_vs_torch_save_throughput": {
            "value": base["save"] / rows["cas"]["save"],
            "target": ">= 1.5",
        },
        "resave10_vs_torch_save_time": {
            "value": rows["cas"]["resave10"] / base["save"],
            "target": "<= 0.2",
        },
        "load_vs_torch_load_speed": {
            "value": base["load"] / rows["cas"]["load"],
            "target": ">= 1.0",
        },
        "cold_load_vs_torch_load_speed": {
            "value": results["cold_load_s"]["torch.save"] / results["cold_load_s"]["cas"],
            "target": ">= 1.0",
        },
    }
    return results


def print_core(results: dict[str, Any]) -> None:
    """The core table."""
    size = results["state_bytes"] / GB
    share = results["changed_bytes"] / results["state_bytes"]
    print(
        f"\n== core: {size:.2f} GiB state dict, {results['tensors']} tensors; durable (fsync) writes"
    )
    print(
        f"   re-save changes {share:.0%} of the bytes; loads touch every page; the peers' files"
        " are in the page cache, and cas reads a chunk file that is not past it the first time"
    )
    print(f"{'writer':<14}{'save s':>9}{'GiB/s':>8}{'resave10% s':>13}{'load s':>9}{'GiB/s':>8}")
    for name, row in results["rows"].items():
        print(
            f"{name:<14}{row['save']:>9.2f}{row['save_gbps']:>8.2f}{row['resave10']:>13.2f}"
            f"{row['load']:>9.2f}{row['load_gbps']:>8.2f}"
        )
    print(f"cas load with mmap: {results['rows']['cas']['load_mmap']:.2f} s")
    print(
        f"cas load_into (into existing tensors, as DCP loads): "
        f"{results['rows']['cas']['load_into']:.2f} s against DCP {results['rows']['dcp']['load']:.2f} s"
    )
    print(
        "first load of each (cas's chunks were written past the page cache): "
        + ", ".join(f"{name} {secs:.2f} s" for name, secs in results["first_load_s"].items())
    )
    print(
        "cold load of each (its files out of the page cache first), median: "
        + ", ".join(f"{name} {secs:.2f} s" for name, secs in results["cold_load_s"].items())
    )
    print(f"cas put of torch.save's .pt file (into an empty store): {results['put_pt_s']:.2f} s")
    print(
        "(safetensors' load maps the file without copying, so a warm load costs only page faults)"
    )
    ceilings = results["ceiling_s"]
    print(
        "plain durable writes of the same bytes (no serialisation, hashing or metadata): "
        + ", ".join(f"{name} {secs:.2f} s" for name, secs in ceilings.items())
    )
    ceiling = results["ceiling"]
    print(
        f"   floor = the fastest of those and cas save; torch.save takes "
        f"{ceiling['torch_save_vs_floor']:.2f}x of it, cas save {ceiling['cas_save_vs_floor']:.2f}x:"
        f" no save here can be more than {ceiling['best_reachable_vs_torch_save']:.2f}x as fast"
        " as torch.save"
    )
    print(
        f"re-save floor (blake3 of every byte on 2 threads while the changed bytes are written "
        f"durably): {results['resave_floor_s']:.2f} s = "
        f"{ceiling['resave_floor_vs_torch_save']:.2f}x torch.save's save; cas re-save "
        f"{ceiling['cas_resave_vs_floor']:.2f}x of it"
    )
    print(f"cas put of the .pt: {ceiling['cas_put_vs_floor']:.2f}x the floor")
    runs = results["save_runs"]
    print("first save, run by run (cas / floor, cas / each peer; met = <= 1.2x floor and fastest):")
    for index, run in enumerate(runs, 1):
        peers = "  ".join(
            f"/{name} {run[f'cas_vs_{name}']:.2f}" for name in ("safetensors", "torch.save", "dcp")
        )
        met = "met" if run["met"] else "not met"
        print(
            f"   run {index}: cas {run['cas_s']:.2f} s, /floor {run['cas_vs_floor']:.2f}  {peers}  {met}"
        )
    print(f"   target met in {sum(r['met'] for r in runs)} of {len(runs)} runs")
    for name, rss in results["peak_rss"].items():
        print(
            f"peak memory of one save above the state, {name}: "
            f"{rss['peak_above_state'] / (1 << 20):.1f} MiB"
            + (f" (staging pool bound {rss['pool_limit'] >> 20} MiB)" if name == "cas" else "")
        )
    for name, target in results["targets"].items():
        print(f"  {name:<40} {target['value']:6.2f}  (target {target['target']})")


def run_section(name: str, quick: bool) -> dict[str, Any] | None:
    """Run ``scripts/bench_<name>.py``'s ``run(quick=...)`` if that script exists."""
    path = ROOT / "scripts" / f"bench_{name}.py"
    if not path.exists():
        print(f"\n== {name}: scripts/bench_{name}.py not present, skipped")
        return None
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    print(f"\n== {name}")
    result: dict[str, Any] = module.run(quick=quick)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="cas benchmarks")
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--sections", default="startup,core,encryption,compression,gc,fs,manager,s3"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (smoke test)")
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "bench.json"))
    parser.add_argument("--workdir", default=None, help="scratch directory on the disk to measure")
    args = parser.parse_args()
    if args.quick:
        args.size_gb, args.repeat = min(args.size_gb, 0.1), 1
    torch.set_num_threads(os.cpu_count() or 1)
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "sections": {},
    }
    for section in [s.strip() for s in args.sections.split(",") if s.strip()]:
        if section == "core":
            with tempfile.TemporaryDirectory(dir=args.workdir or ROOT) as work:
                results = bench_core(Path(work), args.size_gb, args.repeat)
            print_core(results)
            out["sections"]["core"] = results
        else:
            result = run_section(section, args.quick)
            if result is not None:
                out["sections"][section] = result
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
