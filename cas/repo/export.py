"""Writing checkpoints back to files: byte-identical ingested files, or a saved state as .pt/.safetensors."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

from cas.errors import AlreadyExists, FormatError
from cas.model.manifest import FileEntry, Manifest
from cas.names import check_relative_path
from cas.objects.chunkio import ChunkIO, Progress


def export_files(
    io: ChunkIO,
    manifest: Manifest,
    dest: Path,
    *,
    sha256: bool,
    overwrite: bool,
    progress: Progress | None = None,
) -> list[Path]:
    """Write an ingested file or directory back, its chunks read verified through ``io``; a
    single file goes to ``dest`` or ``dest/name``."""
    single = manifest.meta.get("source") == "file" and len(manifest.files) == 1
    if single:
        ((rel, entry),) = manifest.files.items()
        target = dest / rel if dest.is_dir() else dest
        targets = [(target, entry)]
    else:
        if dest.exists() and not dest.is_dir():
            raise AlreadyExists(f"{dest} exists and is not a directory")
        targets = [
            (dest / check_relative_path(rel), e) for rel, e in sorted(manifest.files.items())
        ]
    _check_targets([t for t, _ in targets], sha256=sha256, overwrite=overwrite)
    if not single:
        dest.mkdir(parents=True, exist_ok=True)  # an empty directory comes back too
    written = []
    for target, entry in targets:
        digest = _write_file(io, entry, target, progress)
        written.append(target)
        if sha256:
            written.append(write_sha256_sidecar(target, digest))
    return written


def _check_targets(targets: list[Path], *, sha256: bool, overwrite: bool) -> None:
    """Refuse, before writing anything, what would fail half way or overwrite a user's file."""
    names = {*targets}
    for target in targets:
        parent = target.parent
        while not parent.is_dir():  # up to the first directory that exists
            if parent in names or parent.exists():
                raise AlreadyExists(f"{parent} is a file where a directory is needed")
            parent = parent.parent
        if sha256 and _sidecar_of(target) in names:
            raise AlreadyExists(
                f"{_sidecar_of(target)} is a stored file and the --sha256 sidecar of {target.name}"
            )
    if not overwrite:
        outputs = [*targets, *(_sidecar_of(t) for t in targets)] if sha256 else targets
        clashes = [str(t) for t in outputs if t.exists()]
        if clashes:
            raise AlreadyExists(f"{clashes[0]} exists (use --force to overwrite)")


def _sidecar_of(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _write_file(io: ChunkIO, entry: FileEntry, target: Path, progress: Progress | None) -> str:
    """Stream verified chunks into a temp file beside ``target``, fsync, rename; return sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.cas-tmp"
    hasher = hashlib.sha256()
    try:
        with tmp.open("wb") as f:
            for data in io.iter_chunks(entry.chunks):
                f.write(data)
                hasher.update(data)
                if progress is not None:
                    progress(len(data))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, entry.mode or 0o644)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return hasher.hexdigest()


def write_sha256_sidecar(target: Path, hexdigest: str | None = None) -> Path:
    """Write ``target.sha256`` in GNU coreutils format (``sha256sum -c`` accepts it)."""
    if hexdigest is None:
        hasher = hashlib.sha256()
        with target.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                hasher.update(block)
        hexdigest = hasher.hexdigest()
    sidecar = _sidecar_of(target)
    # Through a temp file, like the file itself: a full disk never leaves half a sidecar.
    tmp = sidecar.with_name(f".{sidecar.name}.{uuid.uuid4().hex[:8]}.cas-tmp")
    try:
        tmp.write_text(f"{hexdigest}  {target.name}\n")
        os.replace(tmp, sidecar)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return sidecar


def export_state(state: Any, dest: Path, fmt: str, *, sha256: bool, overwrite: bool) -> list[Path]:
    """Write a state saved through the API as a ``.pt`` (torch.save) or ``.safetensors`` file."""
    from cas.formats.writers import flatten_state, write_safetensors, write_torch

    if dest.is_dir():
        dest = dest / f"checkpoint.{'safetensors' if fmt == 'safetensors' else 'pt'}"
    if dest.exists() and not overwrite:
        raise AlreadyExists(f"{dest} exists (use --force to overwrite)")
    if fmt == "safetensors":
        tensors, metadata = flatten_state(state)
        write_safetensors(tensors, metadata, dest)
    elif fmt == "pt":
        write_torch(state, dest)
    else:
        raise FormatError(f"unknown export format {fmt!r} (use safetensors or pt)")
    return [dest, write_sha256_sidecar(dest)] if sha256 else [dest]
