"""Benchmark: GC of a local store with up to 1M chunks, and of an S3 store (time, requests, memory).

Chunk files are synthesized directly (tiny payloads in the real object envelope, so they cost
nothing to hash), 100 per manifest; half the manifests are named by refs, so half the chunks are
garbage. Each size runs GC (plan, then execute, grace 0) in a fresh subprocess that reports its
wall times and peak RSS; RSS is also given above the process's baseline after importing cas
(torch dominates that baseline). Sizes 100k / 300k / 1M show how it grows; targets for 1M:
under 60 s and under 1 GB. ``--quick`` is a smoke run (10k / 30k). The store is deleted after
each size.

The S3 part (``--s3-chunks``, 100k; 0 skips it) starts a SeaweedFS of its own
(``cas.testing.SeaweedServer``), uploads the same shape of store with PutObject on 64 threads,
and runs GC the same way, counting every HTTP request the GC process sends by operation (a
botocore ``before-send`` hook, so retries count too).

    .venv/bin/python scripts/bench_gc.py [--quick] [--sizes 100000,300000,1000000]
        [--s3-chunks 100000] [--out FILE]
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
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHUNKS_PER_MANIFEST = 100
PAYLOAD = 8
TARGET_SECONDS, TARGET_BYTES = 60.0, 1 << 30
S3_BUCKET = "bench-gc"
UPLOAD_THREADS = 64


ChunkWriter = Callable[[str, bytes], None]
"""Stores one chunk blob (key, envelope bytes) straight into the store being synthesized."""


def synthesize(repo: Any, chunks: int, write_chunk: ChunkWriter) -> dict[str, int]:
    """``chunks`` chunks through ``write_chunk``, one manifest per 100 (through ``repo``), refs
    to every other manifest."""
    from cas.codecs import codec_by_name
    from cas.digest import Digest, digest_of
    from cas.model.manifest import ChunkRef, Manifest, TensorEntry, encode_manifest
    from cas.objects.envelope import encode_header
    from cas.objects.store import chunk_key

    header = encode_header(codec_by_name("raw"), b"", PAYLOAD)
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
            write_chunk(chunk_key(digest), header + payload)
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
    return {"chunks": chunks, "manifests": manifests, "refs": refs}


def synthesize_local(root: Path, chunks: int) -> dict[str, int]:
    """A local store of ``chunks`` chunk files (see ``synthesize``)."""
    import cas
    from cas.repo.config import StoreConfig

    repo = cas.open(root, config=StoreConfig(), fsync=False)
    for i in range(256):
        (root / "chunks" / f"{i:02x}").mkdir(parents=True, exist_ok=True)

    def write_file(key: str, blob: bytes) -> None:
        fd = os.open(root / key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, blob)
        os.close(fd)

    shape = synthesize(repo, chunks, write_file)
    repo.close()
    return shape


def synthesize_s3(url: str, client: Any, chunks: int) -> dict[str, int]:
    """An S3 store of ``chunks`` chunk objects (see ``synthesize``), uploaded on many threads."""
    import cas
    from cas.repo.config import StoreConfig

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    repo = cas.open(url, config=StoreConfig())
    futures: list[Future[Any]] = []
    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:

        def upload(key: str, blob: bytes) -> None:
            futures.append(
                pool.submit(client.put_object, Bucket=bucket, Key=f"{prefix}/{key}", Body=blob)
            )
            if len(futures) >= 4 * UPLOAD_THREADS:
                for future in futures:
                    future.result()
                futures.clear()

        shape = synthesize(repo, chunks, upload)
        for future in futures:
            future.result()
    repo.close()
    return shape


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM). Unlike ru_maxrss it starts afresh at exec, so a child
    started from a big parent (scripts/bench.py after its 1 GB section) is not charged for it."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def count_requests(repo: Any) -> Counter[str]:
    """Requests the repo's S3 clients send from now on, by operation (empty if not on S3)."""
    from cas.blobstore.s3 import S3BlobStore

    requests: Counter[str] = Counter()
    blobs = repo.blobs
    while not isinstance(blobs, S3BlobStore) and hasattr(blobs, "inner"):
        blobs = blobs.inner
    if not isinstance(blobs, S3BlobStore):
        return requests

    def sent(event_name: str, **_: Any) -> None:
        requests[event_name.rsplit(".", 1)[-1]] += 1  # one per HTTP attempt, retries included

    for client in (blobs._client, blobs._transfers.create_only_client):
        client.meta.events.register("before-send.s3", sent)
    return requests


def child(store: str) -> None:
    """Run GC once on ``store`` and print JSON figures (used in a fresh subprocess)."""
    import cas
    from cas.retention.gc import GCSettings

    baseline = peak_rss_bytes()
    local: dict[str, Any] = {} if "://" in store else {"fsync": False}
    repo = cas.open(store, create=False, **local)
    requests = count_requests(repo)
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
                "chunks_before": plan.stored_chunks,
                "deleted_chunks": result.deleted_chunks,
                "deleted_manifests": result.deleted_manifests,
                "requests": sum(requests.values()),
                "requests_by_operation": dict(requests.most_common()),
            }
        )
    )


def measure(chunks: int, work: Path) -> dict[str, Any]:
    """Synthesize a store of ``chunks`` chunks, GC it in a subprocess, delete it."""
    root = work / f"store-{chunks}"
    t0 = time.perf_counter()
    shape = synthesize_local(root, chunks)
    build = time.perf_counter() - t0
    os.sync()  # the store's files are on disk before GC starts, as in a store written long ago
    figures = gc_in_child(str(root), dict(os.environ))
    shutil.rmtree(root)
    return {**shape, "build_seconds": build, **figures}


def gc_in_child(store: str, env: dict[str, str]) -> dict[str, Any]:
    """GC ``store`` in a fresh process; its figures."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", store],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["deleted_chunks"] == figures["chunks_before"] - figures["reachable_chunks"]
    return figures


def measure_s3(chunks: int, work: Path) -> dict[str, Any]:
    """Upload a store of ``chunks`` chunks to a SeaweedFS of its own and GC it in a subprocess."""
    from cas.testing.seaweed import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, REGION, SeaweedServer

    with SeaweedServer(work / "seaweed") as server:
        server.make_bucket(S3_BUCKET)
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL": server.endpoint_url,
            "AWS_ACCESS_KEY_ID": DUMMY_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }
        url = f"s3://{S3_BUCKET}/gc-{chunks}"
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            t0 = time.perf_counter()
            shape = synthesize_s3(url, server.client(max_pool_connections=UPLOAD_THREADS), chunks)
            build = time.perf_counter() - t0
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        time.sleep(1.1)  # S3 mtimes count whole seconds: everything is older than GC's cutoff
        figures = gc_in_child(url, env)
    return {**shape, "build_seconds": build, **figures}


def describe(backend: str, row: dict[str, Any]) -> str:
    """One table line for a measured store."""
    line = (
        f"{backend:<6}{row['chunks']:>9} chunks {row['manifests']:>6} manifests: GC "
        f"{row['total_seconds']:7.2f} s (plan {row['plan_seconds']:.2f} + sweep "
        f"{row['execute_seconds']:.2f}), {row['total_seconds'] / row['chunks'] * 1e6:.1f} us/chunk, "
        f"peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB "
        f"({row['gc_rss_bytes'] / 2**20:.0f} MiB above the {row['baseline_rss_bytes'] / 2**20:.0f} "
        f"MiB baseline), deleted {row['deleted_chunks']}"
    )
    if row["requests"]:
        by_op = ", ".join(f"{op} {n}" for op, n in row["requests_by_operation"].items())
        line += (
            f"\n      {row['requests']} requests, {row['requests'] / row['chunks']:.2f} per chunk "
            f"({by_op}); store built in {row['build_seconds']:.0f} s"
        )
    return line


def run(
    quick: bool = False, sizes: list[int] | None = None, s3_chunks: int | None = None
) -> dict[str, Any]:
    """Benchmark GC at each size, locally and on S3, and return the figures (``scripts/bench.py``
    calls this)."""
    if sizes is None:
        sizes = [10_000, 30_000] if quick else [100_000, 300_000, 1_000_000]
    s3_chunks = s3_chunks if s3_chunks is not None else (5_000 if quick else 100_000)
    rows = []
    s3_rows = []
    load_before = os.getloadavg()[0]
    print(f"load average before: {load_before:.2f} (the machine may be shared)")
    with tempfile.TemporaryDirectory(
        prefix="cas-bench-gc-", dir=os.environ.get("CAS_BENCH_DIR")
    ) as tmp:
        for size in sizes:
            row = measure(size, Path(tmp))
            rows.append(row)
            print(describe("local", row), flush=True)
        if s3_chunks:
            row = measure_s3(s3_chunks, Path(tmp))
            s3_rows.append(row)
            print(describe("s3", row), flush=True)
    targets = {}
    largest = rows[-1] if rows else None
    if largest is not None and largest["chunks"] >= 1_000_000:
        targets = {
            "gc_1M_seconds": {
                "value": largest["total_seconds"],
                "target": f"< {TARGET_SECONDS:.0f}",
            },
            "gc_1M_peak_rss_gib": {"value": largest["peak_rss_bytes"] / 2**30, "target": "< 1"},
        }
    for row in s3_rows:
        targets[f"gc_s3_{row['chunks'] // 1000}k_requests_per_chunk"] = {
            "value": row["requests"] / row["chunks"],
            "target": "measured",
        }
    for name, target in targets.items():
        print(f"  {name:<32} {target['value']:.2f} (target {target['target']})")
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return {"rows": rows, "s3_rows": s3_rows, "targets": targets, "load_average": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Smoke run: 10k and 30k chunks.")
    parser.add_argument("--sizes", help="Comma-separated chunk counts of the local stores.")
    parser.add_argument(
        "--s3-chunks", type=int, help="Chunks of the S3 store (default 100000; 0 skips S3)."
    )
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "gc.json"))
    parser.add_argument("--child", metavar="STORE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    sizes = [int(s) for s in args.sizes.split(",") if s] if args.sizes is not None else None
    results = run(quick=args.quick, sizes=sizes, s3_chunks=args.s3_chunks)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
