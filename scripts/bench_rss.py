"""Peak memory of one save above the state it saves, measured in a process of its own.

The child builds the state (``bench.make_state``), reads its resident size, resets the kernel's
high-water mark (``/proc/self/clear_refs``), saves once, and reports how far the high-water mark
rose: the save's own memory (staging, copies, serialisation buffers), not the state's.

    python scripts/bench_rss.py cas|torch.save|safetensors WORKDIR [--size-gb 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WRITERS = ("cas", "torch.save", "safetensors")


def measure(writer: str, work: Path, size_gb: float) -> dict[str, Any]:
    """Run the child for ``writer`` and return its report (bytes)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, __file__, writer, str(work), "--size-gb", str(size_gb)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child(writer: str, work: Path, size_gb: float) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench import fsync_path, make_state

    import cas
    from cas.objects.staging import pool_limit, staging_pool

    state = make_state(size_gb)
    work.mkdir(parents=True, exist_ok=True)
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    if writer == "cas":
        repo = cas.open(work / "rss-store")
        repo.save(state, "bench/rss")
        repo.close()
    elif writer == "torch.save":
        import torch

        torch.save(state, work / "rss.pt")
        fsync_path(work / "rss.pt")
    else:
        from safetensors.torch import save_file

        save_file(state, work / "rss.safetensors")
        fsync_path(work / "rss.safetensors")
    return {
        "writer": writer,
        "state_rss": base,
        "peak_above_state": _status("VmHWM") - base,
        "pool_limit": pool_limit(),
        "pool_peak": staging_pool().peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("writer", choices=WRITERS)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--size-gb", type=float, default=1.0)
    args = parser.parse_args()
    print(json.dumps(_child(args.writer, args.workdir, args.size_gb)))


if __name__ == "__main__":
    main()
