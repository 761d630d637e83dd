"""Benchmark: the CLI's start-up against ``import torch``, and ten ``cas put`` calls of .pt files.

Each figure is the median of fresh processes, as wall time and as CPU time (user + system, which
a busy machine disturbs less), and the commands take turns (round robin), so load slows every
column alike and the ratios stay comparable:

- ``python -c "import torch"``: the yardstick;
- ``cas --version`` and ``cas ls`` on a store of a few refs; target: each under 0.25x the first;
- ``cas put`` of ten torch.save files of ~100 MB each, one process per file (as a shell loop or
  a training script's hook would run it); each put scans the pickle without importing torch;
  beside it, ``borg create --compression zstd,3`` of the same files, one archive per file, when
  borg is installed.

``--baseline DIR`` runs every command a second time with an older ``cas`` package first on the
path (``git archive <rev> cas | tar -x -C DIR``), for before/after figures from one run.

    .venv/bin/python scripts/bench_startup.py [--quick] [--repeat 15] [--baseline DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_RATIO = 0.25

Command = tuple[list[str], dict[str, str] | None]
"""An argv and the environment to run it in (None: this one)."""


def cas_command() -> list[str]:
    """The installed ``cas`` script next to this interpreter, else ``python -m cas``."""
    script = Path(sys.executable).with_name("cas")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cas"]


def baseline_env(baseline: Path | None) -> dict[str, str] | None:
    """The environment that puts an older ``cas`` package first on the path."""
    return None if baseline is None else {**os.environ, "PYTHONPATH": str(baseline)}


def timed_run(command: Command) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one run, which must succeed."""
    argv, env = command
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure_startup(store: Path, repeat: int, baseline: Path | None = None) -> dict[str, Any]:
    """Median wall and CPU seconds of each start-up command, run in turns; ratios to torch."""
    cas = cas_command()
    commands: dict[str, Command] = {
        "import torch": ([sys.executable, "-c", "import torch"], None),
        "cas --version": ([*cas, "--version"], None),
        "cas ls": ([*cas, "--store", str(store), "ls"], None),
    }
    if baseline is not None:
        env = baseline_env(baseline)
        commands["baseline cas --version"] = ([*cas, "--version"], env)
        commands["baseline cas ls"] = ([*cas, "--store", str(store), "ls"], env)
    for command in commands.values():
        timed_run(command)  # warm the page cache
    walls: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, command in commands.items():
            wall, cpu = timed_run(command)
            walls[name].append(wall)
            cpus[name].append(cpu)
    wall_s = {name: statistics.median(values) for name, values in walls.items()}
    cpu_s = {name: statistics.median(values) for name, values in cpus.items()}
    return {
        "repeat": repeat,
        "seconds": wall_s,
        "cpu_seconds": cpu_s,
        "ratio_to_import_torch": {
            name: s / wall_s["import torch"] for name, s in wall_s.items() if "cas" in name
        },
        "cpu_ratio_to_import_torch": {
            name: s / cpu_s["import torch"] for name, s in cpu_s.items() if "cas" in name
        },
        "target_ratio": TARGET_RATIO,
    }


def measure_puts(
    work: Path, files: int, megabytes: int, baseline: Path | None = None
) -> dict[str, Any]:
    """Seconds for ``files`` ``cas put`` processes of ~``megabytes`` MB torch.save files."""
    import torch

    paths = []
    for i in range(files):
        path = work / f"ckpt_{i:02d}.pt"
        generator = torch.Generator().manual_seed(i)
        layers = max(1, megabytes // 4)  # 1024x1024 fp32 = 4 MiB per layer
        state = {
            f"layer{j}.weight": torch.randn(1024, 1024, generator=generator) for j in range(layers)
        }
        torch.save(state, path)
        paths.append(path)
    out: dict[str, Any] = {"files": files, "bytes": sum(p.stat().st_size for p in paths)}
    # label: (package on the path, extra put options); "cas auto" compresses as borg does.
    sources: dict[str, tuple[Path | None, list[str]]] = {
        "cas": (None, []),
        "cas auto": (None, ["--codec", "auto"]),
    }
    if baseline is not None:
        sources = {"baseline": (baseline, []), **sources}
    totals = {label: [0.0, 0.0] for label in sources}
    stores = {label: work / f"put-store-{label.replace(' ', '-')}" for label in sources}
    borg = borg_archiver(work / "borg-repo")
    if borg is not None:
        totals["borg"] = [0.0, 0.0]
        stores["borg"] = work / "borg-repo"
    for i, path in enumerate(paths):  # each file by each tool in turn, into its own store
        for label, (source, options) in sources.items():
            argv = [*cas_command(), "--store", str(stores[label]), "-q", "put", *options,
                    str(path), f"r/c{i:02d}"]  # fmt: skip
            wall, cpu = timed_run((argv, baseline_env(source)))
            totals[label][0] += wall
            totals[label][1] += cpu
        if borg is not None:
            wall, cpu = timed_run(borg(path, f"c{i:02d}"))
            totals["borg"][0] += wall
            totals["borg"][1] += cpu
    for label, (wall, cpu) in totals.items():
        stored = sum(p.stat().st_size for p in stores[label].rglob("*") if p.is_file())
        out[label] = {
            "seconds": wall,
            "cpu_seconds": cpu,
            "seconds_per_put": wall / files,
            "stored_ratio": stored / out["bytes"],
        }
    return out


def borg_archiver(repo: Path) -> Callable[[Path, str], Command] | None:
    """When borg is installed: a new unencrypted repository at ``repo`` and the command that
    stores one file in it as an archive with zstd level 3 (one process per file, like ``cas
    put``); None otherwise."""
    if shutil.which("borg") is None:
        return None
    env = {**os.environ, "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes"}
    subprocess.run(["borg", "init", "--encryption=none", str(repo)], check=True, env=env)

    def create(path: Path, name: str) -> Command:
        return (["borg", "create", "--compression", "zstd,3", f"{repo}::{name}", str(path)], env)

    return create


def run(
    quick: bool = False, repeat: int | None = None, baseline: Path | None = None
) -> dict[str, Any]:
    """Measure and print start-up and puts (``scripts/bench.py`` calls this)."""
    repeat = repeat or (3 if quick else 15)
    with tempfile.TemporaryDirectory(
        prefix="cas-bench-startup-", dir=os.environ.get("CAS_BENCH_DIR")
    ) as tmp:
        work = Path(tmp)
        store = work / "small-store"
        source = work / "notes.txt"
        source.write_text("a small file\n" * 100)
        for i in range(5):
            argv = [*cas_command(), "--store", str(store), "put", str(source), f"runs/r{i}/notes"]
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        startup = measure_startup(store, repeat, baseline)
        puts = measure_puts(work, 3 if quick else 10, 8 if quick else 100, baseline)
    print(f"start-up, median of {repeat} fresh processes each, run in turns:")
    print(f"  {'command':<24}{'wall ms':>9}{'x torch':>9}{'CPU ms':>9}{'x torch':>9}")
    for name, wall in startup["seconds"].items():
        cpu = startup["cpu_seconds"][name]
        ratio = startup["ratio_to_import_torch"].get(name)
        cpu_ratio = startup["cpu_ratio_to_import_torch"].get(name)
        ratios = (f"{ratio:>9.2f}", f"{cpu_ratio:>9.2f}") if ratio else (f"{'':>9}", f"{'':>9}")
        print(f"  {name:<24}{wall * 1000:>9.0f}{ratios[0]}{cpu * 1000:>9.0f}{ratios[1]}")
    print(f"  target: cas commands under {TARGET_RATIO}x import torch")
    each = puts["bytes"] / puts["files"] / 1e6
    for label in ("baseline", "cas", "cas auto", "borg"):
        if label in puts:
            row = puts[label]
            what = {"borg": "borg create (zstd,3)", "cas auto": "cas put --codec auto"}.get(
                label, f"{label} put"
            )
            print(
                f"{puts['files']} x {what} of {each:.0f} MB .pt files: {row['seconds']:.2f} s "
                f"wall, {row['cpu_seconds']:.2f} s CPU ({row['seconds_per_put']:.2f} s per file),"
                f" stored {row['stored_ratio']:.3f} of the files"
            )
    return {"startup": startup, "puts": puts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--baseline", type=Path, default=None, help="older cas package's parent")
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "startup.json"))
    args = parser.parse_args()
    result = run(quick=args.quick, repeat=args.repeat, baseline=args.baseline)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
