"""The floor under a compressed store's load: chunk files read, decompressed and hashed with
none of cas's own code in between, beside the same for a raw store (``bench_compression``)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import cas


def load_ceiling(
    plain: cas.Repository, packed: cas.Repository, ref: str, repeat: int = 9
) -> dict[str, float]:
    """The floor under loading ``ref``, with none of cas's own work in between: each chunk's
    file read and blake3-hashed (raw store), or read, its Blosc2 payload (and its delta base's)
    decompressed and the result hashed (compressed store; the delta itself is not applied).
    Both on two threads, one chunk per task, best of ``repeat``, in the same run."""
    from concurrent.futures import ThreadPoolExecutor

    import blake3
    import numpy as np

    from cas.codecs import codec_by_id
    from cas.codecs.blosc import _lib
    from cas.objects.envelope import parse_envelope
    from cas.objects.store import chunk_key

    lib = _lib()

    def chunks_of(repo: cas.Repository) -> list[tuple[Path, int]]:
        refs = {c.digest: c.size for t in repo.manifest(ref).tensors for c in t.chunks}
        paths = [repo.objects.blobs.local_path(chunk_key(d)) for d in refs]
        return [(p, n) for p, n in zip(paths, refs.values(), strict=True) if p is not None]

    def decoded(path: Path, out: Any) -> None:
        blob = path.read_bytes()
        envelope = parse_envelope(blob, 1 << 31)
        payload = memoryview(blob)[envelope.payload_offset :]
        if envelope.codec_id == 0:
            out[:] = np.frombuffer(payload, np.uint8)
            return
        base = codec_by_id(envelope.codec_id).base_of(envelope.params)
        if base is not None:
            decoded(path.parent.parent / base[:2] / base, out)
            out = np.empty_like(out)
        lib.decompress2(payload, dst=out, nthreads=1)

    def read_raw(job: tuple[Path, int]) -> None:
        out = np.empty(job[1] + 16, np.uint8)
        with job[0].open("rb", buffering=0) as f:
            f.readinto(out.data)
        blake3.blake3(out[16:].data).digest()

    def read_packed(job: tuple[Path, int]) -> None:
        out = np.empty(job[1], np.uint8)
        decoded(job[0], out)
        blake3.blake3(out.data).digest()

    work = {"raw": (read_raw, chunks_of(plain)), "packed": (read_packed, chunks_of(packed))}
    best = dict.fromkeys(work, math.inf)
    with ThreadPoolExecutor(2) as pool:
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


def print_ceiling(results: dict[str, Any]) -> None:
    """The load of the newest checkpoint against the floor ``load_ceiling`` measured."""
    print(f"\n{'workload':<15} {'newest load vs raw':>18} {'floor vs raw':>13}  "
          "(floor: chunk files read, Blosc2-decompressed, hashed; 2 threads, no cas)")  # fmt: skip
    for name, row in results["workloads"].items():
        c = row["cas"]
        if "ceiling" in c:
            print(f"{name:<15} {c['newest_load_vs_raw']:18.2f} {c['ceiling']['vs_raw']:13.2f}")
