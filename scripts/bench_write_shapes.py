"""Where a first save's time goes: plain durable writes of the same bytes, shaped step by step
like cas's chunk files, beside cas's own save (docs/design.md, "Where a first save's time goes
now").

Every writer writes the state as 4 MiB files with O_DIRECT from reused buffers, twelve threads,
each file fsynced and then the directory, in interleaved rounds of rotating order:

- ``small pages``: buffers in 4 KiB pages;
- ``huge pages``: buffers in transparent huge pages (as cas's staging pool);
- ``+ temp and link``: each file written under a temp name and linked under its own;
- ``+ header and truncate``: a 16-byte header before the bytes, the file truncated to its length;
- ``+ blake3 first``: each piece hashed before its write, as a name must be known to create it;
- ``cas``: ``Repository.save`` into an empty store.

    python scripts/bench_write_shapes.py [--size-gb 1.0] [--repeat 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import queue
import shutil
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench import CHUNK, fsync_path, huge_page_buffer, interleaved, make_state  # noqa: E402

import cas  # noqa: E402

THREADS = 12
HEADER = 16
ALIGN = 4096


def shapes(work: Path, pieces: list[memoryview]) -> dict[str, Callable[[], None]]:
    """The plain writers, each a function writing every piece once into ``work / "files"``."""
    small: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
    huge: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
    for _ in range(THREADS):
        small.put(
            memoryview(
                mmap.mmap(-1, CHUNK + 2 * ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            )
        )
        huge.put(huge_page_buffer(CHUNK + 2 * ALIGN))
    place = work / "files"
    direct = getattr(os, "O_DIRECT", 0)

    def writer(
        buffers: queue.SimpleQueue[memoryview], *, link: bool, header: bool, hashed: bool
    ) -> Callable[[], None]:
        def one(index: int) -> None:
            buffer = buffers.get()
            try:
                piece = pieces[index]
                at = HEADER if header else 0
                size = at + len(piece)
                array = np.frombuffer(buffer, np.uint8)
                array[at:size] = np.frombuffer(piece, np.uint8)
                name = blake3.blake3(buffer[at:size]).hexdigest() if hashed else f"{index:064x}"
                final = place / name
                path = place / "tmp" / f"{index}.tmp" if link else final
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
                try:
                    os.pwritev(fd, [buffer[: -(-size // ALIGN) * ALIGN]], 0)
                    if size % ALIGN:
                        os.ftruncate(fd, size)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if link:
                    with contextlib.suppress(FileExistsError):  # the same bytes twice: one file
                        os.link(path, final)
                    os.unlink(path)
            finally:
                buffers.put(buffer)

        def write() -> None:
            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(one, range(len(pieces))))
            fsync_path(place)

        return write

    return {
        "small pages": writer(small, link=False, header=False, hashed=False),
        "huge pages": writer(huge, link=False, header=False, hashed=False),
        "+ temp and link": writer(huge, link=True, header=False, hashed=False),
        "+ header and truncate": writer(huge, link=True, header=True, hashed=False),
        "+ blake3 first": writer(huge, link=True, header=True, hashed=True),
    }


def bench(work: Path, size_gb: float, repeat: int) -> dict[str, Any]:
    """Every round's seconds of each writer, and their medians."""
    state = make_state(size_gb)
    views: list[memoryview] = []
    for tensor in state.values():
        flat: Any = tensor.contiguous().numpy()
        views.append(memoryview(flat).cast("B"))
    pieces = [v[i : i + CHUNK] for v in views for i in range(0, len(v), CHUNK)]

    def clear_files() -> None:
        shutil.rmtree(work / "files", ignore_errors=True)
        (work / "files" / "tmp").mkdir(parents=True)

    def clear_store() -> None:
        shutil.rmtree(work / "store", ignore_errors=True)

    counter = iter(range(10**6))

    def cas_save() -> None:
        repo = cas.open(work / "store")
        repo.save(state, f"bench/{next(counter)}")
        repo.close()

    measures: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {
        name: (write, clear_files) for name, write in shapes(work, pieces).items()
    }
    measures["cas"] = (cas_save, clear_store)
    rounds: dict[str, list[float]] = {}
    medians = interleaved(measures, repeat, rounds, warmup=True)
    return {
        "state_bytes": sum(len(v) for v in views),
        "files": len(pieces),
        "threads": THREADS,
        "median_s": medians,
        "rounds_s": rounds,
        "min_s": {name: min(times) for name, times in rounds.items()},
        "max_s": {name: max(times) for name, times in rounds.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=str(ROOT / "bench-results" / "write_shapes.json"))
    parser.add_argument("--workdir", default=None, help="scratch directory on the disk to measure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir or ROOT) as work:
        result = bench(Path(work), args.size_gb, args.repeat)
    print(
        f"{result['state_bytes'] / (1 << 30):.2f} GiB as {result['files']} files of 4 MiB, "
        f"{THREADS} threads, O_DIRECT, fsync each; {args.repeat} rounds, rotating order"
    )
    print(f"{'writer':<24}{'median s':>10}{'min':>8}{'max':>8}")
    for name, median in result["median_s"].items():
        print(
            f"{name:<24}{median:>10.3f}{result['min_s'][name]:>8.3f}{result['max_s'][name]:>8.3f}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
