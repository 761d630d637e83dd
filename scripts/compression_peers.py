"""The compression benchmark's peers: borg, restic, ZipNN per file, and the plain files.

Each peer stores the same checkpoint directories as cas, in the same order, and reports what
``scripts/bench_compression.py`` prints beside cas: stored bytes, ingest seconds, and the wall
time to load the newest checkpoint into memory as tensors, which is what a resume does. For the
archivers that is an extract (borg) or restore (restic) into a scratch directory followed by
``torch.load`` of what came out; for ZipNN the decompression and the load; for the plain files
``torch.load`` alone (``safetensors.torch.load_file`` for ``.safetensors``). Every peer's load is
checked against ``torch.load`` of the original files once, so a peer that loads fast but wrong
cannot enter the table.

ZipNN (PyPI ``zipnn``, the ``bench`` extra) is used as its README recommends: ``.safetensors``
files tensor by tensor (the format its safetensors plugin reads), any other file whole as bytes
with ``bytearray_dtype`` set to the file's dominant float type. It keeps no history, so every
checkpoint and every copy is compressed on its own.

``print_side_by_side`` prints every system's row, cas's included, from the benchmark's results.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ZIPNN_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""The float types ZipNN's byte input takes as ``bytearray_dtype``."""

TOOL_LOAD_REPEAT = 3
"""Best-of count for a peer's newest load when it runs a subprocess (extract, restore)."""


def checkpoint_dirs(checkpoints: list[Path], copies: list[Path]) -> list[Path]:
    """All directories a workload stores, in the order they are ingested (checkpoints, copies)."""
    return [*checkpoints, *copies]


def dir_bytes(path: Path) -> int:
    """Bytes of all files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def load_files(directory: Path) -> dict[str, Any]:
    """What a resume reads from a checkpoint directory: each ``.pt`` and ``.safetensors`` in it.

    ``.safetensors`` files are read into memory (``safetensors.torch.load`` of their bytes), as
    every other system here loads them: ``load_file`` maps the file and would time page-table
    setup rather than a load.
    """
    from safetensors.torch import load

    state: dict[str, Any] = {}
    for path in sorted(directory.rglob("*")):
        if path.name.endswith(".safetensors"):
            state[path.name] = load(path.read_bytes())
        elif path.suffix == ".pt":
            state[path.name] = torch.load(path, weights_only=True)
    return state


def same_state(a: object, b: object) -> bool:
    """Whether two loaded states hold the same values, tensors compared bit for bit.

    Bits, not values: ``torch.equal`` takes ``-0.0`` for ``0.0`` and a NaN for unequal to itself.
    """
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def write_synced(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Write a file and fsync it, as cas, borg and restic make their writes durable."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    """The least wall time of ``repeat`` calls of ``fn``."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


# -- plain files ------------------------------------------------------------------------------


def measure_files(dirs: list[Path], newest: Path, work: Path, repeat: int) -> dict[str, Any]:
    """The files themselves, copied (and fsynced) into a directory, loaded with torch.load."""
    target = work / "files-copy"
    started = time.perf_counter()
    for i, directory in enumerate(dirs):
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            out = target / str(i) / path.relative_to(directory)
            out.parent.mkdir(parents=True, exist_ok=True)
            write_synced(out, path.read_bytes())
    elapsed = time.perf_counter() - started
    newest_copy = target / str(dirs.index(newest))
    return {
        "seconds": elapsed,
        "stored_bytes": dir_bytes(target),
        "newest_load_s": best_of(repeat, lambda: load_files(newest_copy)),
    }


# -- ZipNN per file ---------------------------------------------------------------------------


def zipnn_available() -> bool:
    """Whether the ``zipnn`` package imports in this interpreter."""
    try:
        import zipnn  # noqa: F401
    except ImportError:
        return False
    return True


def dominant_float(path: Path) -> str:
    """The float type holding most of a torch file's tensor bytes, in ZipNN's spelling.

    A ZipNN user picks ``bytearray_dtype`` knowing their model, so the bench reads it from the
    file before the timed ingest rather than inside it.
    """
    by_dtype: dict[torch.dtype, int] = {}

    def walk(value: object) -> None:
        if isinstance(value, torch.Tensor):
            by_dtype[value.dtype] = by_dtype.get(value.dtype, 0) + value.nbytes
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(torch.load(path, weights_only=True))
    floats = {d: n for d, n in by_dtype.items() if d in ZIPNN_DTYPES}
    return ZIPNN_DTYPES[max(floats, key=floats.__getitem__)] if floats else "float32"


def zipnn_compress_safetensors(source: Path, target: Path) -> None:
    """ZipNN's safetensors route: float tensors compressed one by one, the rest kept as they are.

    The result is the ``.znn.safetensors`` layout that ``zipnn_safetensors()`` reads: compressed
    tensors stored as uint8 with their dtype and shape in the file's metadata.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file
    from zipnn import ZipNN
    from zipnn.util_safetensors import (
        COMPRESSED_DTYPE,
        COMPRESSION_METHOD,
        build_compressed_tensor_info,
        set_compressed_tensors_metadata,
    )

    tensors: dict[str, torch.Tensor] = {}
    infos: dict[str, Any] = {}
    with safe_open(str(source), "pt", "cpu") as f:
        # ZipNN records which tensors it compressed in the file's metadata, but only when the
        # file already has some: without any its tensors would read back still compressed.
        metadata = f.metadata() or {"format": "pt"}
        for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
            tensor = f.get_tensor(name)
            if tensor.dtype not in ZIPNN_DTYPES:
                tensors[name] = tensor
                continue
            info = build_compressed_tensor_info(tensor)
            # ZipNN 0.5.4 reorders its input's bytes in place (and get_tensor can hand back
            # the same pages again), so it compresses a copy; the original is kept for
            # a tensor that does not shrink.
            packed = ZipNN(
                input_format="torch", bytearray_dtype=tensor.dtype, method=COMPRESSION_METHOD
            ).compress(tensor.clone())
            if len(packed) >= tensor.nbytes:
                tensors[name] = tensor
                continue
            tensors[name] = torch.frombuffer(bytearray(packed), dtype=COMPRESSED_DTYPE)
            infos[name] = info
    set_compressed_tensors_metadata(infos, metadata)
    save_file(tensors, str(target), metadata)
    with open(target, "rb+") as f:
        os.fsync(f.fileno())


def zipnn_load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.znn.safetensors`` file, through ZipNN's own reader."""
    from zipnn.zipnn import SafeOpen

    with SafeOpen(str(path), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def zipnn_load_dir(directory: Path, dtypes: dict[str, str]) -> dict[str, Any]:
    """The checkpoint ZipNN stored in ``directory``, keyed like ``load_files`` keys the original."""
    state: dict[str, Any] = {}
    for path in sorted(directory.iterdir()):
        if path.name.endswith(".znn.safetensors"):
            original = path.name.removesuffix(".znn.safetensors") + ".safetensors"
            state[original] = zipnn_load_safetensors(path)
        elif path.suffix == ".znn":
            original = path.name.removesuffix(".znn")
            state[original] = torch.load(
                io.BytesIO(zipnn_unpack(path, dtypes[original])), weights_only=True
            )
    return state


def zipnn_pack(path: Path, dtype: str) -> bytes:
    """A whole file through ZipNN's byte route: its compressed bytes, then one byte of padding.

    ZipNN 0.5.4 corrupts the heap (glibc aborts, sometimes later) when its input's length is not
    a multiple of the element size, which a torch zip file's rarely is; so the input is padded
    with zeros to a multiple of 4 and the padding's length ends the stored file. ZipNN also
    reorders its input's bytes in place, so the buffer is read for this call alone.
    """
    from zipnn import ZipNN

    data = bytearray(path.read_bytes())
    pad = -len(data) % 4
    data += bytes(pad)
    return bytes(ZipNN(bytearray_dtype=dtype).compress(data)) + bytes([pad])


def zipnn_unpack(path: Path, dtype: str) -> bytes | bytearray | memoryview:
    """The original bytes of a file ``zipnn_pack`` stored."""
    from zipnn import ZipNN

    stored = memoryview(path.read_bytes())
    raw = ZipNN(bytearray_dtype=dtype).decompress(stored[:-1])
    pad = stored[-1]
    return memoryview(raw)[: len(raw) - pad] if pad else raw


def measure_zipnn(dirs: list[Path], newest: Path, work: Path, repeat: int) -> dict[str, Any]:
    """ZipNN per file: every file of every directory compressed on its own, no dedup."""
    dtypes = {
        p.name: dominant_float(p) for d in dirs for p in d.rglob("*") if p.suffix == ".pt"
    }  # every .pt of one workload has one name per layout, so one dtype per name
    target = work / "zipnn"
    stored: list[Path] = []
    started = time.perf_counter()
    for i, directory in enumerate(dirs):
        out_dir = target / str(i)
        out_dir.mkdir(parents=True)
        stored.append(out_dir)
        for path in sorted(p for p in directory.iterdir() if p.is_file()):
            if path.name.endswith(".safetensors"):
                stem = path.name.removesuffix(".safetensors")
                zipnn_compress_safetensors(path, out_dir / f"{stem}.znn.safetensors")
            elif path.suffix == ".pt":
                write_synced(out_dir / f"{path.name}.znn", zipnn_pack(path, dtypes[path.name]))
            else:
                write_synced(out_dir / path.name, path.read_bytes())
    elapsed = time.perf_counter() - started
    newest_stored = stored[dirs.index(newest)]
    if not same_state(zipnn_load_dir(newest_stored, dtypes), load_files(newest)):
        raise AssertionError("ZipNN's load of the newest checkpoint differs from its files")
    return {
        "version": importlib.metadata.version("zipnn"),
        "seconds": elapsed,
        "stored_bytes": dir_bytes(target),
        "newest_load_s": best_of(repeat, lambda: zipnn_load_dir(newest_stored, dtypes)),
        "bytearray_dtype": dtypes,
    }


# -- borg and restic --------------------------------------------------------------------------


def tool_env(tool: str, repo: Path, work: Path) -> dict[str, str]:
    """The environment borg or restic runs in: an unencrypted or fixed-password repository."""
    return {**os.environ, "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes",
            "RESTIC_PASSWORD": "bench", "RESTIC_REPOSITORY": str(repo),
            "RESTIC_CACHE_DIR": str(work / "restic-cache")}  # fmt: skip


@contextmanager
def scratch(work: Path) -> Iterator[Path]:
    """A directory to extract into, removed afterwards (outside the caller's timing)."""
    path = Path(tempfile.mkdtemp(dir=work, prefix="extract-"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


def tool_load(tool: str, repo: Path, work: Path, archive: int) -> dict[str, Any]:
    """Extract one archive of ``repo`` and torch.load what came out; the wall time of both."""
    env = tool_env(tool, repo, work)
    with scratch(work) as target:
        started = time.perf_counter()
        if tool == "borg":
            cmd = ["borg", "extract", f"{repo}::c{archive}"]
        else:
            cmd = ["restic", "restore", "latest", "--tag", f"c{archive}", "--target", str(target)]
        subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=target)
        state = load_files(target)
        return {"seconds": time.perf_counter() - started, "state": state}


def measure_tool(
    tool: str, dirs: list[Path], newest: Path, work: Path, name: str
) -> dict[str, Any] | None:
    """Archive each checkpoint directory with borg or restic; None when not installed."""
    if shutil.which(tool) is None:
        return None
    repo = work / f"{tool}-{name}"
    env = tool_env(tool, repo, work)
    if tool == "borg":
        init = ["borg", "init", "--encryption", "none", str(repo)]
    else:
        init = ["restic", "init", "--repository-version", "2"]
    subprocess.run(init, env=env, check=True, capture_output=True)
    version = subprocess.run([tool, "--version" if tool == "borg" else "version"], env=env,
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    started = time.perf_counter()
    for i, directory in enumerate(dirs):
        if tool == "borg":
            cmd = ["borg", "create", "--compression", "zstd,3", f"{repo}::c{i}", "."]
        else:
            cmd = ["restic", "backup", "--compression", "auto", "--quiet", "--tag", f"c{i}", "."]
        subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=directory)
    elapsed = time.perf_counter() - started
    archive = dirs.index(newest)
    first = tool_load(tool, repo, work, archive)
    if not same_state(first["state"], load_files(newest)):
        raise AssertionError(f"{tool}'s restore of the newest checkpoint differs from its files")
    loads = [first["seconds"]] + [
        tool_load(tool, repo, work, archive)["seconds"] for _ in range(TOOL_LOAD_REPEAT - 1)
    ]
    return {
        "version": version,
        "seconds": elapsed,
        "stored_bytes": dir_bytes(repo),
        "newest_load_s": min(loads),
    }


# -- all of them ------------------------------------------------------------------------------

PEERS = ("files", "zipnn", "borg", "restic")
"""The peers' keys in a workload's row, in the order the table prints them."""


def peer_rows(
    dirs: list[Path], newest: Path, work: Path, name: str, archivers: bool, repeat: int = 5
) -> dict[str, dict[str, Any] | str]:
    """Every peer's row for one workload, or a note saying why a peer was left out.

    ``dirs`` are the directories in ingest order and ``newest`` the one a resume loads; a peer
    whose tool or package is missing, or the archivers when ``archivers`` is false (quick runs),
    get a note instead of figures, never an error.
    """
    raw_bytes = sum(dir_bytes(d) for d in dirs)
    work = work / f"peers-{name}"
    work.mkdir()
    rows: dict[str, dict[str, Any] | str] = {}
    measured: dict[str, dict[str, Any] | None] = {
        "files": measure_files(dirs, newest, work, repeat)
    }
    if zipnn_available():
        measured["zipnn"] = measure_zipnn(dirs, newest, work, repeat)
    else:
        rows["zipnn"] = "not installed (pip install zipnn, or the bench extra)"
    for tool in ("borg", "restic"):
        if not archivers:
            rows[tool] = "skipped (--quick)"
            continue
        measured[tool] = measure_tool(tool, dirs, newest, work, name)
        if measured[tool] is None:
            rows[tool] = (
                f"not installed (apt-get install {'borgbackup' if tool == 'borg' else tool})"
            )
    for peer, row in measured.items():
        if row is not None:
            row["ratio"] = row["stored_bytes"] / raw_bytes
            row["ingest_mb_s"] = raw_bytes / row["seconds"] / 1e6
            rows[peer] = row
    return {peer: rows[peer] for peer in PEERS}


def side_by_side(row: dict[str, Any]) -> list[tuple[str, dict[str, float] | str]]:
    """One workload's systems: stored/raw, ingest seconds and newest-load seconds, or a note."""
    c = row["cas"]
    keyframe = c["schemes"]["keyframe"]
    systems: list[tuple[str, dict[str, float] | str]] = [
        ("cas raw", {"ratio": c["raw_store_ratio"], "ingest_s": c["raw_ingest_s"],
                     "newest_load_s": c["raw_newest_load_s"]}),
        ("cas auto", {"ratio": keyframe["ratio"], "ingest_s": keyframe["ingest_s"],
                      "newest_load_s": keyframe["newest_load_s"]}),
    ]  # fmt: skip
    labels = {"files": "torch.load", "zipnn": "ZipNN", "borg": "borg", "restic": "restic"}
    for peer in PEERS:
        value = row.get(peer, "not measured")
        if isinstance(value, dict):
            value = {"ratio": value["ratio"], "ingest_s": value["seconds"],
                     "newest_load_s": value["newest_load_s"]}  # fmt: skip
        systems.append((labels[peer], value))
    return systems


def print_side_by_side(results: dict[str, Any]) -> None:
    """Every system on the same files: bytes stored, ingest time, load of the newest."""
    print(f"\n{'workload':<15} {'system':<11} {'stored/raw':>10} {'ingest s':>9} "
          f"{'newest load s':>13} {'vs cas raw':>10}")  # fmt: skip
    for name, row in results["workloads"].items():
        systems = side_by_side(row)
        raw_load = row["cas"]["raw_newest_load_s"]
        for system, value in systems:
            if isinstance(value, str):
                print(f"{name:<15} {system:<11} {value}")
                continue
            print(f"{name:<15} {system:<11} {value['ratio']:10.3f} {value['ingest_s']:9.2f} "
                  f"{value['newest_load_s']:13.4f} {raw_load / value['newest_load_s']:10.2f}")  # fmt: skip
    print("(torch.load: the files as they are, copied; its newest load is torch.load, or")
    print(" safetensors.torch.load of the file's bytes. borg/restic: extract, then the same.")
    print(" ZipNN: decompress, then the same. vs cas raw: the newest load's speed as a fraction")
    print(" of cas raw's.)")
