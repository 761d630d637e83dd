"""Benchmark: GC of a local store with up to 1M chunks and 10k manifests (time and peak memory).

Chunk files are synthesized directly (tiny payloads in the real object envelope, so they cost
nothing to hash), 100 per manifest; half the manifests are named by refs, so half the chunks are
garbage. Each size runs GC (plan, then execute, grace 0) in a fresh subprocess that reports its
wall times and peak RSS; RSS is also given above the process's baseline after importing cas
(torch dominates that baseline). Sizes 100k / 300k / 1M show how it grows; targets for 1M:
under 60 s and under 1 GB. ``--quick`` is a smoke run (10k / 30k). The store is deleted after
each size.

    .venv/bin/python scripts/bench_gc.py [--quick] [--sizes 100000,300000,1000000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHUNKS_PER_MANIFEST = 100
PAYLOAD = 8
TARGET_SECONDS, TARGET_BYTES = 60.0, 1 << 30


def synthesize(root: Path, chunks: int) -> dict[str, int]:
    """A store with ``chunks`` chunk files, one manifest per 100, refs to every other manifest."""
    import cas
    from cas.codecs import codec_by_name
    from cas.digest import Digest, digest_of
    from cas.model.manifest import ChunkRef, Manifest, TensorEntry, encode_manifest
    from cas.objects.envelope import encode_header
    from cas.repo.config import StoreConfig

    repo = cas.open(root, config=StoreConfig(), fsync=False)
    header = encode_header(codec_by_name("raw"), b"", PAYLOAD)
    chunk_dir = root / "chunks"
    for i in range(256):
        (chunk_dir / f"{i:02x}").mkdir(parents=True, exist_ok=True)
    tree = {"~": "dict", "items": [["w", {"~": "tensor", "i": 0}]]}
    zstd = codec_by_name("zstd")
    manifests = refs = 0
    refs_made: list[tuple[str, Digest]] = []
    for start in range(0, chunks, CHUNKS_PER_MANIFEST):
        count = min(CHUNKS_PER_MANIFEST, chunks - start)
        digests = []
        for i in range(start, start + count):
            payload = struct.pack("<Q", i)
            digest = digest_of(payload)
            fd = os.open(
                chunk_dir / digest[:2] / digest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
            )
            os.write(fd, header + payload)
            os.close(fd)
            digests.append(ChunkRef(digest, PAYLOAD))
        entry = TensorEntry("torch", "uint8", (count * PAYLOAD,), count * PAYLOAD, tuple(digests))
        manifest = Manifest("state", (entry,), tree, created_at=float(start))
        digest = repo.objects.put_manifest(encode_manifest(manifest), zstd)
        manifests += 1
        if manifests % 2 == 0:
            refs_made.append((f"runs/r{manifests // 1000:03d}/ckpt_{manifests:06d}", digest))
    for name, digest in refs_made:
        repo.refs_store.set(name, digest)
        refs += 1
    repo.close()
    return {"chunks": chunks, "manifests": manifests, "refs": refs}


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM). Unlike ru_maxrss it starts afresh at exec, so a child
    started from a big parent (scripts/bench.py after its 1 GB section) is not charged for it."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(store: str) -> None:
    """Run GC once on ``store`` and print JSON figures (used in a fresh subprocess)."""
    import cas
    from cas.retention.gc import GCSettings

    baseline = peak_rss_bytes()
    repo = cas.open(store, create=False, fsync=False)
    started = time.perf_counter()
    plan = repo.plan_gc(GCSettings(grace=0, reflog_window=0))
    planned = time.perf_counter()
    result = plan.execute()
    done = time.perf_counter()
    peak = peak_rss_bytes()
    print(
        json.dumps(
            {
                "plan_seconds": planned - started,
                "execute_seconds": done - planned,
                "total_seconds": done - started,
                "peak_rss_bytes": peak,
                "baseline_rss_bytes": baseline,
                "gc_rss_bytes": peak - baseline,
                "reachable_chunks": plan.reachable_chunks,
                "deleted_chunks": result.deleted_chunks,
                "deleted_manifests": result.deleted_manifests,
            }
        )
    )


def measure(chunks: int, work: Path) -> dict[str, Any]:
    """Synthesize a store of ``chunks`` chunks, GC it in a subprocess, delete it."""
    root = work / f"store-{chunks}"
    t0 = time.perf_counter()
    shape = synthesize(root, chunks)
    build = time.perf_counter() - t0
    os.sync()  # the store's files are on disk before GC starts, as in a store written long ago
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(root)], check=True, capture_output=True, text=True
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["deleted_chunks"] == chunks - figures["reachable_chunks"], figures
    shutil.rmtree(root)
    return {**shape, "build_seconds": build, **figures}


def run(quick: bool = False, sizes: list[int] | None = None) -> dict[str, Any]:
    """Benchmark GC at each size and return the figures (``scripts/bench.py`` calls this)."""
    sizes = sizes or ([10_000, 30_000] if quick else [100_000, 300_000, 1_000_000])
    rows = []
    with tempfile.TemporaryDirectory(
        prefix="cas-bench-gc-", dir=os.environ.get("CAS_BENCH_DIR")
    ) as tmp:
        for size in sizes:
            row = measure(size, Path(tmp))
            rows.append(row)
            print(
                f"{row['chunks']:>9} chunks {row['manifests']:>6} manifests: GC "
                f"{row['total_seconds']:6.2f} s (plan {row['plan_seconds']:.2f} + sweep "
                f"{row['execute_seconds']:.2f}), {row['total_seconds'] / row['chunks'] * 1e6:.1f} us/chunk, "
                f"peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB "
                f"({row['gc_rss_bytes'] / 2**20:.0f} MiB above the {row['baseline_rss_bytes'] / 2**20:.0f} MiB "
                f"baseline), deleted {row['deleted_chunks']}",
                flush=True,
            )
    largest = rows[-1]
    targets = {}
    if largest["chunks"] >= 1_000_000:
        targets = {
            "gc_1M_seconds": {
                "value": largest["total_seconds"],
                "target": f"< {TARGET_SECONDS:.0f}",
            },
            "gc_1M_peak_rss_gib": {"value": largest["peak_rss_bytes"] / 2**30, "target": "< 1"},
        }
        for name, target in targets.items():
            print(f"  {name:<24} {target['value']:.2f} (target {target['target']})")
    return {"rows": rows, "targets": targets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Smoke run: 10k and 30k chunks.")
    parser.add_argument("--sizes", help="Comma-separated chunk counts.")
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "gc.json"))
    parser.add_argument("--child", metavar="STORE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    results = run(quick=args.quick, sizes=sizes)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
