"""Benchmark: how fast ``cas ui`` answers on a large local store (100 runs, 10,000 checkpoints).

Builds the store once (each run: a few real saves, the rest copies, so building stays quick while
every checkpoint is its own ref), a training history per run, a pool and a stored policy; then
starts the server, lets it compute its whole-store snapshots (as ``cas ui`` does in the background
when it starts; that time is printed apart) and times each route's JSON answer several times. The
target is 200 ms per answer on a local store; pages are paginated so a page's cost does not grow
with the store.

    python scripts/bench_ui.py [--runs 100] [--per-run 100] [--repeat 5] [--workdir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

import cas
from cas.retention.policy import RetentionPolicy, Rule
from cas.training.history import TrainingHistory
from cas.ui.server import UIServer

TARGET_SECONDS = 0.2


def build(path: Path, runs: int, per_run: int) -> cas.Repository:
    """``runs`` runs of ``per_run`` checkpoints each, with histories and a policy."""
    repo = cas.open(str(path))
    base = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
    for r in range(runs):
        run = f"runs/r{r:03d}"
        distinct = []
        for k in range(4):
            head = np.full((64, 64), r + k / 10, dtype=np.float32)
            meta = {"step": 0, "metrics": {"loss": 1.0 / (1 + k)}, "status": "running"}
            ref = f"{run}/phase1/ckpt_phase1_step{k:08d}"
            repo.save({"model": {"base": base, "head": head}}, ref, metadata=meta)
            distinct.append(ref)
        for step in range(len(distinct), per_run):
            repo.cp(distinct[step % len(distinct)], f"{run}/phase1/ckpt_phase1_step{step:08d}")
        repo.cp(f"{run}/phase1/ckpt_phase1_step{per_run - 1:08d}", f"{run}/latest")
        records: list[dict[str, Any]] = [
            {"step": s, "loss": 2.0 / (1 + 0.01 * s)} for s in range(per_run * 10)
        ]
        records += [
            {"step": s * 10, "event": "save", "ref": f"{run}/phase1/ckpt_phase1_step{s:08d}"}
            for s in range(per_run)
        ]
        TrainingHistory(repo, f"{run}/history").append(records)
    repo.store_retention_policy(
        RetentionPolicy(rules=(Rule(select="runs/*/phase*/ckpt_*", group_by=2, keep_last=3),))
    )
    return repo


def timed(url: str, token: str, repeat: int) -> list[float]:
    """Seconds each of ``repeat`` JSON answers took (after one warm-up)."""
    request = urllib.request.Request(
        url, headers={"Accept": "application/json", "Authorization": f"token {token}"}
    )
    times = []
    for i in range(repeat + 1):
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as answer:
            answer.read()
        if i:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--per-run", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path, help="write the result here as JSON")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cas-bench-ui-"))
    start = time.perf_counter()
    repo = build(work / "store", args.runs, args.per_run)
    built = time.perf_counter() - start
    server = UIServer(repo, label="bench")
    server.start()
    start = time.perf_counter()
    server.warm().join()  # what `cas ui` starts with, in the background
    warmed = time.perf_counter() - start
    middle = f"runs/r{args.runs // 2:03d}"
    routes = {
        "runs": "/",
        "runs, last page": f"/?page={max(1, args.runs // 50)}",
        "run": f"/run?name={middle}",
        "checkpoint": f"/checkpoint?ref={middle}/latest",
        "storage": "/storage",
        "retention": "/retention",
        "pools": "/pools",
    }
    rows: dict[str, Any] = {}
    try:
        for name, path in routes.items():
            times = timed(f"http://127.0.0.1:{server.port}{path}", server.token, args.repeat)
            rows[name] = {
                "min_s": min(times),
                "median_s": statistics.median(times),
                "max_s": max(times),
                "within_target": statistics.median(times) <= TARGET_SECONDS,
            }
    finally:
        server.shutdown()
        repo.close()
    result = {
        "runs": args.runs,
        "checkpoints": args.runs * args.per_run,
        "build_s": built,
        "snapshots_s": warmed,
        "target_s": TARGET_SECONDS,
        "routes": rows,
    }
    print(f"{args.runs} runs, {args.runs * args.per_run} checkpoints (built in {built:.0f} s)")
    print(f"whole-store snapshots computed in the background at start: {warmed:.1f} s")
    print(f"{'route':<18} {'min s':>8} {'median s':>9} {'max s':>8}  <= {TARGET_SECONDS} s")
    for name, row in rows.items():
        print(
            f"{name:<18} {row['min_s']:8.3f} {row['median_s']:9.3f} {row['max_s']:8.3f}  "
            f"{'yes' if row['within_target'] else 'NO'}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
