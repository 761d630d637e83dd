"""Benchmark: cas push/pull to a local SeaweedFS against a plain parallel boto3 upload/download.

One run starts its own SeaweedFS (``cas.testing.SeaweedServer``), saves a transformer-shaped fp32
state (~1 GiB; ``--quick``: ~100 MiB) into a local cas store and writes the same tensors as plain
files, then times, side by side and alternating, for ``repeat`` rounds:

- boto3 upload: every file through one ``s3transfer`` TransferManager (16 threads, multipart
  above 8 MiB), which is what ``aws s3 cp --recursive`` does;
- cas push: ``Repository.push`` of the checkpoint into a fresh S3 store (16 jobs);
- boto3 download of those files into a fresh directory (page cache, no fsync);
- cas pull: ``Repository.pull`` into a fresh local store (every chunk fsynced, every byte
  re-hashed).

Then one large blob (``--blob-mb``, 256 MiB; 0 skips it) goes up and comes down ``repeat`` times
through ``S3BlobStore.put``/``get`` (multipart uploads and ranged GETs through s3transfer above
``multipart_threshold``) and through one boto3 TransferManager from and to memory.

Ratios are boto3 time / cas time (1.0 = as fast as boto3; the target is 0.8 or more). The load
average is recorded around each measurement because the machine is shared.

    python scripts/bench_s3.py [--quick] [--size-gb 1.0] [--repeat 2] [--blob-mb 256] [--work DIR]

Results go to ``bench-results/s3.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cas  # noqa: E402
from cas.blobstore.s3 import S3BlobStore  # noqa: E402
from cas.testing.seaweed import (  # noqa: E402
    DUMMY_ACCESS_KEY,
    DUMMY_SECRET_KEY,
    REGION,
    SeaweedServer,
)

GiB = 1 << 30
MiB = 1 << 20
BUCKET = "bench"
JOBS = 16
P = ParamSpec("P")
R = TypeVar("R")


def make_state(size_gb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformer-shaped fp32 state dict of about ``size_gb`` GiB (4-16 MiB tensors)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = 1024
    per_layer = (4 * hidden * hidden + 2 * hidden * 4 * hidden) * 4
    state: dict[str, torch.Tensor] = {}
    for i in range(max(1, round(size_gb * GiB / per_layer))):
        for name in ("q", "k", "v", "o"):
            state[f"layers.{i}.attn.{name}.weight"] = torch.randn(
                hidden, hidden, generator=generator
            )
        state[f"layers.{i}.mlp.up.weight"] = torch.randn(4 * hidden, hidden, generator=generator)
        state[f"layers.{i}.mlp.down.weight"] = torch.randn(hidden, 4 * hidden, generator=generator)
    return state


def write_files(state: dict[str, torch.Tensor], directory: Path) -> list[Path]:
    """The same tensor bytes as one plain file per tensor."""
    directory.mkdir(parents=True)
    paths = []
    for name, tensor in state.items():
        path = directory / f"{name}.bin"
        path.write_bytes(tensor.numpy().tobytes())
        paths.append(path)
    return paths


def boto3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    # Same connection pool as cas's client; checksums only where S3 requires them, as cas does
    # (blake3 verifies cas's bytes; the baseline verifies nothing beyond TCP).
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=DUMMY_ACCESS_KEY,
        aws_secret_access_key=DUMMY_SECRET_KEY,
        region_name=REGION,
        config=Config(
            max_pool_connections=64,
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def _transfer_manager(client: Any) -> Any:
    from boto3.s3.transfer import TransferConfig, TransferManager

    config = TransferConfig(
        multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB, max_concurrency=JOBS
    )
    return TransferManager(client, config)


def boto3_upload(client: Any, paths: list[Path], prefix: str) -> None:
    """Upload every file in parallel through one TransferManager."""
    with _transfer_manager(client) as manager:
        futures = [manager.upload(str(p), BUCKET, f"{prefix}/{p.name}") for p in paths]
        for future in futures:
            future.result()


def boto3_download(client: Any, names: list[str], prefix: str, directory: Path) -> None:
    """Download every object in parallel into ``directory``."""
    directory.mkdir(parents=True)
    with _transfer_manager(client) as manager:
        futures = [
            manager.download(BUCKET, f"{prefix}/{name}", str(directory / name)) for name in names
        ]
        for future in futures:
            future.result()


def _timed(
    action: Callable[P, R], *args: P.args, **kwargs: P.kwargs
) -> tuple[float, R, list[float]]:
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    result = action(*args, **kwargs)
    seconds = time.perf_counter() - began
    return seconds, result, [round(load_before, 2), round(os.getloadavg()[0], 2)]


def run(quick: bool = False, size_gb: float | None = None, repeat: int | None = None,
        work: str | None = None, blob_mb: int = 256) -> dict[str, Any]:  # fmt: skip
    """Run the benchmark; return the figures (also printed)."""
    size_gb = size_gb if size_gb is not None else (0.1 if quick else 1.0)
    repeat = repeat if repeat is not None else (1 if quick else 2)
    root = Path(tempfile.mkdtemp(prefix="cas-bench-s3-", dir=work))
    saved_env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID=DUMMY_ACCESS_KEY, AWS_SECRET_ACCESS_KEY=DUMMY_SECRET_KEY)
    try:
        with SeaweedServer(root / "seaweed") as server:
            server.make_bucket(BUCKET)
            result = _measure(server, root, size_gb, repeat)
            if blob_mb:
                result["large_blob"] = _measure_large_blob(server, blob_mb * MiB, repeat)
            return result
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(root, ignore_errors=True)


def _measure(server: SeaweedServer, root: Path, size_gb: float, repeat: int) -> dict[str, Any]:
    state = make_state(size_gb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    local = cas.open(root / "local")
    local.save(state, "runs/bench/ckpt")
    paths = write_files(state, root / "files")
    names = [p.name for p in paths]
    del state
    client = boto3_client(server.endpoint_url)
    rounds: list[dict[str, Any]] = []
    for r in range(repeat):
        row: dict[str, Any] = {}
        seconds, _, load = _timed(boto3_upload, client, paths, f"files{r}")
        row["boto3_upload"] = {"seconds": seconds, "load": load}
        remote = cas.open(f"s3://{BUCKET}/cas{r}", endpoint_url=server.endpoint_url)
        seconds, report, load = _timed(local.push, remote, ["runs/bench/ckpt"], jobs=JOBS)
        assert report.bytes_moved == nbytes, report.as_dict()
        row["cas_push"] = {"seconds": seconds, "load": load}
        target = root / f"download{r}"
        seconds, _, load = _timed(boto3_download, client, names, f"files{r}", target)
        row["boto3_download"] = {"seconds": seconds, "load": load}
        shutil.rmtree(target)
        fresh = cas.open(root / f"pulled{r}")
        seconds, report, load = _timed(fresh.pull, remote, ["runs/bench/ckpt"], jobs=JOBS)
        assert report.bytes_moved == nbytes and fresh.resolve("runs/bench/ckpt") == local.resolve(
            "runs/bench/ckpt"
        )
        row["cas_pull"] = {"seconds": seconds, "load": load}
        fresh.close()
        shutil.rmtree(root / f"pulled{r}")
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v['seconds']:.2f}s" for k, v in row.items()))

    def best(name: str) -> float:
        return float(min(row[name]["seconds"] for row in rounds))

    def mbps(name: str) -> float:
        return round(nbytes / MiB / best(name), 1)

    result = {
        "bytes": nbytes,
        "files": len(paths),
        "chunk_size": local.config.chunk_size,
        "jobs": JOBS,
        "repeat": repeat,
        "cpus": os.cpu_count(),
        "rounds": rounds,
        "best_seconds": {name: round(best(name), 3) for name in rounds[0]},
        "MiB_per_s": {name: mbps(name) for name in rounds[0]},
        "push_ratio": round(best("boto3_upload") / best("cas_push"), 3),
        "pull_ratio": round(best("boto3_download") / best("cas_pull"), 3),
        "median_load": statistics.median(
            v for row in rounds for m in row.values() for v in m["load"]
        ),
    }
    print(
        f"{nbytes / GiB:.2f} GiB: push {result['MiB_per_s']['cas_push']} MiB/s vs boto3 "
        f"{result['MiB_per_s']['boto3_upload']} (ratio {result['push_ratio']}); pull "
        f"{result['MiB_per_s']['cas_pull']} MiB/s vs boto3 {result['MiB_per_s']['boto3_download']} "
        f"(ratio {result['pull_ratio']}); load ~{result['median_load']}"
    )
    return result


def _measure_large_blob(server: SeaweedServer, size: int, repeat: int) -> dict[str, Any]:
    """One ``size``-byte blob up and down through S3BlobStore and through boto3, best of ``repeat``."""
    data = os.urandom(size)
    store = S3BlobStore.from_url(f"s3://{BUCKET}/blob", endpoint_url=server.endpoint_url)
    client = boto3_client(server.endpoint_url)
    seconds: dict[str, list[float]] = {}

    @contextmanager
    def timed(name: str) -> Iterator[None]:
        began = time.perf_counter()
        yield
        seconds.setdefault(name, []).append(time.perf_counter() - began)

    with _transfer_manager(client) as manager:
        for r in range(repeat):
            with timed("cas_put"):
                store.put(f"cas{r}", data)
            with timed("cas_get"):
                got = store.get(f"cas{r}")
            assert got == data
            with timed("boto3_upload"):
                manager.upload(io.BytesIO(data), BUCKET, f"blob/boto3{r}").result()
            out = io.BytesIO()
            with timed("boto3_download"):
                manager.download(BUCKET, f"blob/boto3{r}", out).result()
            assert out.getvalue() == data
    store.close()
    rates = {name: round(size / MiB / min(times), 1) for name, times in seconds.items()}
    print(
        f"one {size // MiB} MiB blob: put {rates['cas_put']} MiB/s vs boto3 "
        f"{rates['boto3_upload']}; get {rates['cas_get']} MiB/s vs boto3 {rates['boto3_download']}"
    )
    return {"bytes": size, "MiB_per_s": rates, "load": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~100 MiB, one round")
    parser.add_argument("--size-gb", type=float, default=None)
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--work", default=None, help="directory for temporary data")
    parser.add_argument("--blob-mb", type=int, default=256, help="one large blob; 0 skips it")
    args = parser.parse_args()
    result = run(args.quick, args.size_gb, args.repeat, args.work, args.blob_mb)
    out = ROOT / "bench-results" / "s3.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
