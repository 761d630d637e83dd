"""Floors and bounds printed beside ``bench_compression``'s figures.

- ``load_ceiling``: the floor under a compressed store's load: chunk files read, decompressed and
  hashed with none of cas's own code in between, beside the same for a raw store.
- ``parallel_load``: a load with one chunk read at a time against the default, so the table
  shows how much of one load the second core takes.
- ``entropy_bound``: the order-0 entropy of the best delta chain over a ``.pt`` run, beside the
  stored/raw target.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import cas


def load_ceiling(
    plain: cas.Repository, packed: cas.Repository, ref: str, repeat: int = 9
) -> dict[str, float]:
    """The floor under loading ``ref``, with none of cas's own work in between: each chunk's
    file read into a buffer the thread reuses and blake3-hashed (raw store), or read, its Blosc2
    payload (and its delta base's) decompressed and the result hashed (compressed store; the
    delta itself is not applied). Two and three threads, one chunk per task, best of ``repeat``
    of the faster, the two stores in turn in the same run."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import blake3
    import numpy as np

    from cas.codecs import codec_by_id
    from cas.codecs.blosc import _lib
    from cas.objects.envelope import parse_envelope
    from cas.objects.store import chunk_key

    lib = _lib()
    local = threading.local()

    def scratch(name: str, size: int) -> Any:
        """A buffer of at least ``size`` bytes this thread keeps (no allocation per chunk)."""
        buf = getattr(local, name, None)
        if buf is None or len(buf) < size:
            buf = np.empty(size, np.uint8)
            setattr(local, name, buf)
        return buf[:size]

    def chunks_of(repo: cas.Repository) -> list[tuple[str, int]]:
        refs = {c.digest: c.size for t in repo.manifest(ref).tensors for c in t.chunks}
        paths = [repo.objects.blobs.local_path(chunk_key(d)) for d in refs]
        return [(str(p), n) for p, n in zip(paths, refs.values(), strict=True) if p is not None]

    def read_file(path: str, name: str) -> Any:
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = scratch(name, os.fstat(fd).st_size)
            got = os.readv(fd, [buf])
        finally:
            os.close(fd)
        return buf[:got]

    def decoded(path: str, out: Any, depth: int = 0) -> None:
        blob = read_file(path, f"file{depth}")
        envelope = parse_envelope(blob, 1 << 31)
        payload = blob[envelope.payload_offset :]
        if envelope.codec_id == 0:
            out[:] = payload
            return
        base = codec_by_id(envelope.codec_id).base_of(envelope.params)
        if base is not None:
            decoded(os.path.join(os.path.dirname(os.path.dirname(path)), base[:2], base), out,
                    depth + 1)  # fmt: skip
            out = scratch(f"delta{depth}", len(out))
        lib.decompress2(payload, dst=out, nthreads=1)

    def read_raw(job: tuple[str, int]) -> None:
        blake3.blake3(read_file(job[0], "file0")[-job[1] :]).digest()

    def read_packed(job: tuple[str, int]) -> None:
        out = scratch("out", job[1])
        decoded(job[0], out)
        blake3.blake3(out).digest()

    work = {"raw": (read_raw, chunks_of(plain)), "packed": (read_packed, chunks_of(packed))}
    best = dict.fromkeys(work, math.inf)
    for threads in (2, 3):
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(repeat):  # the two in turn, so drift on a shared machine hits both
                for name, (read, jobs) in work.items():
                    started = time.perf_counter()
                    list(pool.map(read, jobs))
                    best[name] = min(best[name], time.perf_counter() - started)
    return {
        "raw_s": best["raw"],
        "packed_s": best["packed"],
        "vs_raw": best["raw"] / best["packed"],
    }


def parallel_load(repo: cas.Repository, ref: str, repeat: int = 7) -> dict[str, float]:
    """``Repository.load`` of ``ref`` with one chunk read at a time against the store's default
    (one per core plus one, locally): how much of the load the second core takes."""
    serial = cas.Repository(repo.blobs, repo.config, workers=1, owns_blobs=False)
    try:
        times: dict[str, float] = {"serial_s": math.inf, "parallel_s": math.inf}
        for _ in range(repeat):  # in turn, so drift hits both
            for key, which in (("serial_s", serial), ("parallel_s", repo)):
                started = time.perf_counter()
                which.load(ref)
                times[key] = min(times[key], time.perf_counter() - started)
    finally:
        serial.close()
    times["speedup"] = times["serial_s"] / times["parallel_s"]
    return times


def entropy_bound(checkpoints: list[Path]) -> dict[str, float]:
    """What the best delta chain could store at best, over the bytes of ``checkpoints`` (one
    ``.pt`` run, oldest first): the first checkpoint standalone and every later one a delta
    against the one before it (an unbounded chain), each tensor taking the smallest of its
    standalone bytes, the XOR and the zigzag difference against its parent, each costed at the
    order-0 entropy of its byte planes (what a shuffle plus an entropy coder can reach without
    modelling one byte from another). Returned per tensor kind and for the whole run, as a
    fraction of the checkpoint files' bytes."""
    import numpy as np
    import torch

    from cas.model.state import encode_state

    def tensors(path: Path) -> dict[str, Any]:
        """Each non-empty float tensor of the checkpoint, by cas's dotted path, as integers."""
        _, sources = encode_state(torch.load(path, map_location="cpu", weights_only=True))
        return {
            s.path: np.frombuffer(s.data, dtype=f"<i{s.elem_size}")
            for s in sources
            if "float" in s.dtype and s.nbytes
        }

    def planes_bytes(values: Any) -> float:
        """Order-0 entropy of each byte plane, in bytes."""
        planes = values.view(np.uint8).reshape(-1, values.itemsize)
        total = 0.0
        for p in range(values.itemsize):
            counts = np.bincount(planes[:, p], minlength=256).astype(np.float64)
            counts = counts[counts > 0]
            total -= float((counts * np.log2(counts / counts.sum())).sum())
        return total / 8

    def zigzag(diff: Any, dtype: Any) -> Any:
        return ((diff << 1) ^ (diff >> 63)).astype(dtype)

    by_kind: dict[str, float] = {}
    files = sum(p.stat().st_size for p in checkpoints)
    previous: dict[str, Any] = {}
    for index, path in enumerate(checkpoints):
        current = tensors(path)
        for name, values in current.items():
            kind = "first" if index == 0 else name.rsplit(".", 1)[-1]
            costs = [planes_bytes(values)]
            parent = previous.get(name)
            if parent is not None and parent.shape == values.shape:
                costs.append(planes_bytes(values ^ parent))
                diff = values.astype(np.int64) - parent.astype(np.int64)
                costs.append(planes_bytes(zigzag(diff, values.dtype)))
            by_kind[kind] = by_kind.get(kind, 0.0) + min(costs)
        previous = current
    result = {kind: cost / files for kind, cost in by_kind.items()}
    result["run"] = sum(by_kind.values()) / files
    return result


def print_ceiling(results: dict[str, Any]) -> None:
    """The load of the newest checkpoint against its floor, one read at a time against the
    default, and the stored ratio against its target and the entropy bound."""
    print(f"\n{'workload':<15} {'newest vs raw':>13} {'floor vs raw':>12} {'1 read ms':>9} "
          f"{'default ms':>10} {'speedup':>7} {'stored/raw':>10} {'target':>6} {'bound':>6}")  # fmt: skip
    for name, row in results["workloads"].items():
        c = row["cas"]
        floor = c.get("ceiling", {}).get("vs_raw", math.nan)
        par = c.get("parallel_load", {})
        bound = c.get("entropy_bound", {}).get("run", math.nan)
        print(
            f"{name:<15} {c['newest_load_vs_raw']:13.2f} {floor:12.2f} "
            f"{par.get('serial_s', math.nan) * 1e3:9.1f} {par.get('parallel_s', math.nan) * 1e3:10.1f} "
            f"{par.get('speedup', math.nan):7.2f} {c['ratio']:10.3f} {c['target']:6.2f} {bound:6.3f}"
        )
    print("floor: chunk files read, Blosc2-decompressed and hashed with no cas code (2-3 threads);"
          " 1 read / default: Repository.load of the newest with one chunk read at a time and with"
          " the default readers; bound: order-0 entropy of byte planes of the best unbounded delta"
          " chain (each tensor standalone, XOR or difference against its parent), over the files'"
          " bytes (.pt runs only)")  # fmt: skip
