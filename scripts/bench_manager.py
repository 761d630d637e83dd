"""Benchmark: checkpoint overhead of CheckpointManager on a small CPU training loop, and its peers'.

Measures (1) the overhead of saving every 50 steps of a small CPU training loop, as the extra
time of a 50-step window that starts with a save against one that does not (async saves at low
and at normal priority, and synchronous saves); (2) how long one async ``save`` blocks the loop
against a synchronous ``torch.save`` of the same state to a file. Each row also gives the extra
process CPU of a window with a save (``save_cpu_ms``) and the CPU cost of creating one file in its
store (``file_create_us``), which on some filesystems sets much of the spread. At each batch
size, ``peers`` measures the manager (its defaults) against ``torch.distributed.checkpoint``'s
``async_save`` (one process, no process group) and a synchronous ``torch.save`` plus fsync on
the same loop, their windows interleaved, and says whether cas's overhead is at or below both
(the target; ``cas_at_or_below_peers_every_batch``). Writes JSON to
``bench-results/manager.json``; ``--quick`` is a smoke run. One batch-64 row saves with
``yield_thread=True``; one more runs in a child process with ``OMP_WAIT_POLICY=PASSIVE``, and
alternating child processes measure what that policy costs the loop without checkpoints
(docs/training.md, "Measured").

    .venv/bin/python scripts/bench_manager.py [--quick] [--out bench-results/manager.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import torch

import cas
from cas.training.manager import CheckpointManager

LONG_RUN_EVENTS = 10_000
"""Moves of ``latest`` (and of the history ref) before the long-run row is measured."""


def build(width: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, 16),
    )  # fmt: skip
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor) -> None:
    loss = model(data).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def blocking_comparison(width: int, root: Path, repeats: int) -> dict[str, float]:
    """One async save's blocking time vs a synchronous torch.save of the same state."""
    model, opt = build(width)
    train_step(model, opt, torch.randn(8, width))  # the AdamW moments exist from the first step
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    repo = cas.open(root / "blocking-store")
    async_times, write_times, torch_times = [], [], []
    mgr = CheckpointManager(repo, run="blocking", signals=False, capture_rng=False)
    for i in range(repeats):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)  # new bytes each save, as in training
        pending = mgr.save(i + 1, state)
        async_times.append(pending.blocking_seconds)
        write_times.append(pending.result().write_seconds)
        target = root / f"torch_save_{i}.pt"
        start = time.perf_counter()
        torch.save(state, target)
        torch_times.append(time.perf_counter() - start)
        target.unlink()
    mgr.close()
    repo.close()
    return {
        "async_save_blocking_ms": 1000 * statistics.median(async_times),
        "async_save_blocking_ms_min": 1000 * min(async_times),
        "async_save_background_write_ms": 1000 * statistics.median(write_times),
        "torch_save_sync_ms": 1000 * statistics.median(torch_times),
        "torch_save_sync_ms_min": 1000 * min(torch_times),
    }


def paired_windows(
    width: int,
    batch: int,
    every: int,
    root: Path,
    pairs: int,
    nice: int | None,
    async_save: bool = True,
    history_events: int = 0,
    yield_thread: bool = False,
) -> dict[str, float | list[float]]:
    """Overhead of one checkpoint on the ``every`` steps that follow it, window against window.

    Windows of ``every`` steps alternate: one starts with a save (its blocking copy, then the
    background write overlapping the steps, then a wait for anything still unwritten), the
    next has no save. Each pair is compared on its own, so load from other processes cancels
    out; the median of the per-pair differences is the overhead of saving every ``every`` steps.
    ``history_events`` first gives the run's ``latest`` and history refs that many moves, as a
    long run's refs have (a save moves both). ``yield_thread`` saves with that manager option and
    calls ``step_end`` after each step, which gives the lent thread back.
    """
    model, opt = build(width)
    data = torch.randn(batch, width)
    store = root / f"paired-{nice}-{async_save}-{yield_thread}"
    repo = cas.open(store)
    mgr = CheckpointManager(
        repo, run="paired", signals=False, background_nice=nice, async_save=async_save,
        yield_thread=yield_thread,
    )  # fmt: skip
    counter = [0]
    blocking: list[float] = []

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    def window(save: bool) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        if save:
            counter[0] += 1
            blocking.append(mgr.save(counter[0], state).blocking_seconds)
        for _ in range(every):
            train_step(model, opt, data)
            if yield_thread:
                mgr.step_end(counter[0], state)
        mgr.wait()
        return time.perf_counter() - start, time.process_time() - cpu

    window(False), window(True)
    mgr.wait()
    for ref in (mgr.latest_ref, mgr.history.ref):
        target = repo.resolve(ref)
        for _ in range(history_events):
            repo.refs_store.set(ref, target, op="bench")
    create_us = file_create_us(store / "tmp")
    diffs, bases, cpu_diffs = [], [], []
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        timed = {save: window(save) for save in order}
        bases.append(timed[False][0])
        diffs.append(100 * (timed[True][0] - timed[False][0]) / timed[False][0])
        cpu_diffs.append(timed[True][1] - timed[False][1])
    mgr.close()
    low, high = median_interval(diffs)
    return {
        "overhead_pct": statistics.median(diffs),
        "overhead_pct_p25": statistics.quantiles(diffs, n=4)[0],
        "overhead_pct_p75": statistics.quantiles(diffs, n=4)[2],
        "overhead_pct_ci95": [low, high],
        "pairs": pairs,
        "window_ms": 1000 * statistics.median(bases),
        "blocking_ms": 1000 * statistics.median(blocking),
        "save_cpu_ms": 1000 * statistics.median(cpu_diffs),
        "file_create_us": create_us,
        "ref_history_events": history_events,
    }


class Saver(Protocol):
    """One way to checkpoint the loop: start a save at a window's start, wait at its end."""

    def start(self, step: int, state: Callable[[], dict[str, Any]]) -> None: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...


class ManagerSaver:
    """``CheckpointManager`` with its defaults (async, normal priority, RNG captured)."""

    def __init__(self, root: Path) -> None:
        self.repo = cas.open(root / "peers-cas")
        self.mgr = CheckpointManager(self.repo, run="peers", signals=False)

    def start(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        self.mgr.save(step, state)

    def wait(self) -> None:
        self.mgr.wait()

    def close(self) -> None:
        self.mgr.close()
        self.repo.close()


class DCPAsyncSaver:
    """``torch.distributed.checkpoint.async_save`` in one process, no process group.

    Its default stager copies the state to CPU memory before returning; a thread then writes
    it with ``FileSystemWriter``, which fsyncs its files.
    """

    def __init__(self, root: Path) -> None:
        self.root = root / "peers-dcp"
        self.pending: Future[Any] | None = None
        # Said on every save, from the writer thread too: "torch.distributed is disabled ...,
        # assuming the intent is to save in a single process". It is.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

    def start(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        response = self.save(step, state())
        self.pending = (
            response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        )

    def save(self, step: int, state: dict[str, Any]) -> Any:
        """Start DCP's ``async_save`` of ``state`` as checkpoint ``step``; return its response."""
        from torch.distributed.checkpoint.state_dict_saver import async_save

        return async_save(state, checkpoint_id=self.root / f"step_{step}", no_dist=True)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        self.wait()


class TorchSaveSync:
    """``torch.save`` of the state to a new file, then fsync: the loop waits for all of it."""

    def __init__(self, root: Path) -> None:
        self.root = root / "peers-torch"
        self.root.mkdir()

    def start(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        path = self.root / f"step_{step}.pt"
        with open(path, "wb") as f:
            torch.save(state(), f)
            f.flush()
            os.fsync(f.fileno())

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


SAVERS: dict[str, Callable[[Path], Saver]] = {
    "cas": ManagerSaver,
    "dcp_async_save": DCPAsyncSaver,
    "torch_save_sync": TorchSaveSync,
}
"""The savers compared window against window: cas's manager and its two peers."""


def peer_windows(width: int, batch: int, every: int, root: Path, rounds: int) -> dict[str, Any]:
    """Each saver's overhead on the same loop, its windows interleaved with the others'.

    A round runs one window of ``every`` steps per saver and one without a save, in an order
    that rotates from round to round, so drift in the machine's speed reaches every saver alike;
    each saver's overhead in a round is against that round's window without a save, and its
    overhead is the median over rounds (brackets: a 95% bootstrap interval).
    """
    model, opt = build(width)
    data = torch.randn(batch, width)
    workdir = root / f"peers-{batch}"
    workdir.mkdir()
    savers = {name: make(workdir) for name, make in SAVERS.items()}
    counter = [0]

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    def window(saver: Saver | None) -> tuple[float, float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        blocked = 0.0
        if saver is not None:
            counter[0] += 1
            saver.start(counter[0], state)
            blocked = time.perf_counter() - start
        for _ in range(every):
            train_step(model, opt, data)
        if saver is not None:
            saver.wait()
        return time.perf_counter() - start, time.process_time() - cpu, blocked

    kinds: list[str | None] = [None, *savers]
    for kind in kinds:  # warm-up: first saves allocate, import and create directories
        window(savers[kind] if kind else None)
    diffs: dict[str, list[float]] = {name: [] for name in savers}
    ms_diffs: dict[str, list[float]] = {name: [] for name in savers}
    cpu_diffs: dict[str, list[float]] = {name: [] for name in savers}
    blocking: dict[str, list[float]] = {name: [] for name in savers}
    bases = []
    for r in range(rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        timed = {kind: window(savers[kind] if kind else None) for kind in order}
        base, base_cpu, _ = timed[None]
        bases.append(base)
        for name in savers:
            wall, cpu, blocked = timed[name]
            diffs[name].append(100 * (wall - base) / base)
            ms_diffs[name].append(1000 * (wall - base))
            cpu_diffs[name].append(cpu - base_cpu)
            blocking[name].append(blocked)
    for saver in savers.values():
        saver.close()
    rows: dict[str, Any] = {"rounds": rounds, "window_ms": 1000 * statistics.median(bases)}
    for name in savers:
        low, high = median_interval(diffs[name])
        rows[name] = {
            "overhead_pct": statistics.median(diffs[name]),
            "overhead_pct_ci95": [low, high],
            "overhead_ms": statistics.median(ms_diffs[name]),
            "blocking_ms": 1000 * statistics.median(blocking[name]),
            "save_cpu_ms": 1000 * statistics.median(cpu_diffs[name]),
        }
    rows["cas_at_or_below_peers"] = all(
        rows["cas"]["overhead_pct"] <= rows[peer]["overhead_pct"]
        for peer in SAVERS
        if peer != "cas"
    )
    return rows


def file_create_us(directory: Path, count: int = 20) -> float:
    """CPU microseconds to create one empty file in ``directory``, where the store's writes go.

    On ext4 without a journal this varies from about 10 us to over 700 us with the directory's
    inode group and with how many inodes were freed there in the last minutes: the allocator
    skips each recently deleted one (kernel ``recently_deleted``). A save creates about 14 files,
    so this is a large part of the run-to-run spread; the files are kept, to add no deletions.
    """
    probe = directory / f"create-probe-{time.monotonic_ns()}"
    probe.mkdir()
    start = time.thread_time()
    for i in range(count):
        os.close(os.open(probe / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return 1e6 * (time.thread_time() - start) / count


def median_interval(values: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval for the median of ``values`` (percentile method, fixed seed)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def report(results: dict[str, Any]) -> None:
    """Print the overheads and the blocking comparison side by side."""
    print(f"state {results['state_bytes'] / 1e6:.1f} MB, a save every {results['save_every_n_steps']} "
          f"steps; overhead = median over paired windows [95% bootstrap interval]")  # fmt: skip
    for batch in ("batch64", "batch512"):
        rows = results[batch]
        cells = [
            f"{mode} {row['overhead_pct']:5.1f}% [{row['overhead_pct_ci95'][0]:.1f}, "
            f"{row['overhead_pct_ci95'][1]:.1f}] (window {row['window_ms']:.0f} ms, "
            f"CPU {row['save_cpu_ms']:.0f} ms, create {row['file_create_us']:.0f} us)"
            for mode, row in rows.items()
        ]
        print(f"  {batch}")
        for cell in cells:
            print(f"    {cell}")
    print(f"  OMP_WAIT_POLICY=PASSIVE slows the batch-64 loop itself (no checkpoints) by "
          f"{results['omp_passive_loop_cost']['loop_slowdown_pct']:.1f}%")  # fmt: skip
    report_peers(results)
    print(f"  one save blocks the loop: cas async {results['async_save_blocking_ms']:.1f} ms "
          f"(background write {results['async_save_background_write_ms']:.1f} ms), "
          f"torch.save {results['torch_save_sync_ms']:.1f} ms")  # fmt: skip


def report_peers(results: dict[str, Any]) -> None:
    """cas's manager against DCP async_save and torch.save, and whether it meets the target."""
    labels = {"cas": "cas CheckpointManager", "dcp_async_save": "dcp.async_save",
              "torch_save_sync": "torch.save+fsync"}  # fmt: skip
    print("  against its peers, windows interleaved round by round on the same loop "
          "(overhead [95% interval], extra ms, blocking ms):")  # fmt: skip
    for batch, rows in results["peers"].items():
        print(f"    {batch} ({rows['rounds']} rounds, window {rows['window_ms']:.0f} ms)")
        for name, label in labels.items():
            row = rows[name]
            low, high = row["overhead_pct_ci95"]
            print(f"      {label:<22} {row['overhead_pct']:5.1f}% [{low:.1f}, {high:.1f}] "
                  f"{row['overhead_ms']:6.1f} ms  blocks {row['blocking_ms']:5.1f} ms")  # fmt: skip
        verdict = "yes" if rows["cas_at_or_below_peers"] else "no"
        print(f"      cas at or below both peers: {verdict}")
    met = "met" if results["cas_at_or_below_peers_every_batch"] else "not met"
    print(f"  target (cas at or below both peers at every batch size): {met}")


def sizes(quick: bool) -> tuple[int, int, int]:
    """Model width, steps between saves and window pairs of a batch-64 row."""
    return (512, 25, 6) if quick else (1024, 50, 30)


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark and return its figures.

    The machine may be shared, so the overhead is measured window against window
    (``paired_windows``), for a light-compute loop (batch 64: a 25 MB state saved every ~0.4 s)
    and a heavier one (batch 512), each with async saves at the default normal priority
    (``nice0``), at a lower one (``nice10``) and with synchronous saves.
    """
    width, every, pairs64 = sizes(quick)
    params = sum(p.numel() for p in build(width)[0].parameters())
    results: dict[str, Any] = {
        "quick": quick,
        "model_params": params,
        "state_bytes": params * 4 * 3,
        "save_every_n_steps": every,
        "target": "cas's overhead at or below dcp_async_save's and torch_save_sync's, every batch",
        "peers": {},
    }
    with tempfile.TemporaryDirectory(prefix="cas-bench-manager-") as tmp:
        root = Path(tmp)
        for batch, pairs in ((64, pairs64), (512, 3 if quick else 12)):
            results[f"batch{batch}"] = {
                "async_nice0": paired_windows(width, batch, every, root, pairs, 0),
                "async_nice10": paired_windows(width, batch, every, root, pairs, 10),
                "sync": paired_windows(width, batch, every, root, pairs, 0, async_save=False),
            }
            results["peers"][f"batch{batch}"] = peer_windows(width, batch, every, root, pairs)
        results["cas_at_or_below_peers_every_batch"] = all(
            row["cas_at_or_below_peers"] for row in results["peers"].values()
        )
        # A long run: a save every 0.5 s moves latest 10,000 times in under 1.5 hours.
        results["batch64"]["async_nice0_long_run"] = paired_windows(
            width,
            64,
            every,
            root,
            pairs64,
            0,
            history_events=1_000 if quick else LONG_RUN_EVENTS,
        )
        results["batch64"]["async_yield_thread"] = paired_windows(  # at its default nice 10
            width, 64, every, root, pairs64, None, yield_thread=True
        )
        results["batch64"]["async_nice0_omp_passive"] = passive_row(quick)
        results["omp_passive_loop_cost"] = passive_loop_cost(quick)
        results.update(blocking_comparison(width, root, 5 if quick else 15))
    results.update(
        torch_threads=torch.get_num_threads(), cpus=os.cpu_count(),
        load_average_1m=os.getloadavg()[0],
    )  # fmt: skip
    report(results)
    return results


def passive_row(quick: bool) -> dict[str, Any]:
    """The batch-64 async row again, in a process whose OpenMP threads sleep at a barrier.

    libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads it, hence a child process. By
    default a training thread that reaches a barrier first spins there; when the background save
    has preempted its partner, the spin holds the other core the save could have used. The row's
    overhead is against the same loop under the same policy; ``passive_loop_cost`` gives what
    the policy itself costs that loop.
    """
    row: dict[str, Any] = child(["--passive-row"], quick, "PASSIVE")
    return row


def passive_loop_cost(quick: bool) -> dict[str, Any]:
    """How much slower the batch-64 loop runs without any checkpoint under ``PASSIVE``.

    Child processes alternate (default then passive, passive then default, ...) so that drift in
    the machine's speed cancels; each gives the median of its 50-step windows.
    """
    slowdowns, windows = [], []
    for i in range(2 if quick else 6):
        order = ("default", "PASSIVE") if i % 2 == 0 else ("PASSIVE", "default")
        ms = {policy: float(child(["--loop-window"], quick, policy)) for policy in order}
        windows.append(ms)
        slowdowns.append(100 * (ms["PASSIVE"] - ms["default"]) / ms["default"])
    return {"loop_slowdown_pct": statistics.median(slowdowns), "windows_ms": windows}


def child(flags: list[str], quick: bool, wait_policy: str) -> Any:
    """Run this script with ``flags`` under an OpenMP wait policy; its last line, as JSON."""
    argv = [sys.executable, __file__, *flags] + (["--quick"] if quick else [])
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if wait_policy != "default":
        env["OMP_WAIT_POLICY"] = wait_policy
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def loop_window_ms(quick: bool) -> float:
    """The median 50-step window of the batch-64 loop with no checkpoints at all."""
    width, every, _ = sizes(quick)
    model, opt = build(width)
    data = torch.randn(64, width)
    times = []
    for _ in range(9):
        start = time.perf_counter()
        for _ in range(every):
            train_step(model, opt, data)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--out", default="bench-results/manager.json")
    parser.add_argument("--passive-row", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loop-window", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.loop_window:
        print(json.dumps(loop_window_ms(args.quick)))
        return 0
    if args.passive_row:
        width, every, pairs = sizes(args.quick)
        with tempfile.TemporaryDirectory(prefix="cas-bench-manager-") as tmp:
            row = paired_windows(width, 64, every, Path(tmp), pairs, 0)
        print(json.dumps(row))
        return 0
    results = run(args.quick)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
