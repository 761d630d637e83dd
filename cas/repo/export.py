"""Writing checkpoints back to files: byte-identical ingested files, or a saved state as .pt/.safetensors."""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

from cas.errors import AlreadyExists, FormatError, NotFound, NothingSelected
from cas.model.manifest import FileEntry, Manifest
from cas.names import check_relative_path
from cas.objects.chunkio import ChunkIO, Progress

NAME_MAX = 255
"""Bytes in one file name on the filesystems cas writes to (Linux, macOS)."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


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
    single file goes to ``dest`` or ``dest/name``.

    Nothing is written through a symlink below ``dest``: directories are opened one level at a
    time without following links (``O_NOFOLLOW``), files are created under short temp names and
    renamed into place, and a link where a directory is needed refuses the whole get.
    """
    single = manifest.meta.get("source") == "file" and len(manifest.files) == 1
    if single:
        ((rel, entry),) = manifest.files.items()
        # ``dest`` itself is the user's to choose, a link included; what is below it is not.
        if dest.is_dir():
            targets = [(dest, tuple(check_relative_path(rel).split("/")), entry)]
        else:
            targets = [(dest.parent, (dest.name,), entry)]
    else:
        if dest.exists() and not dest.is_dir():
            raise AlreadyExists(f"{dest} exists and is not a directory")
        targets = [
            (dest, tuple(check_relative_path(rel).split("/")), e)
            for rel, e in sorted(manifest.files.items())
        ]
    _check_targets(targets, sha256=sha256, overwrite=overwrite)
    if not single:
        dest.mkdir(parents=True, exist_ok=True)  # an empty directory comes back too
    written = []
    for root, parts, entry in targets:
        target = root.joinpath(*parts)
        with _directory(root, parts[:-1]) as parent:
            digest = _write_file(io, entry, parent, parts[-1], progress)
            written.append(target)
            if sha256:
                _write_new(parent, _sidecar_name(parts[-1]), _sidecar_text(target, digest), 0o644)
                written.append(_sidecar_of(target))
    return written


def select_files(manifest: Manifest, patterns: Iterable[str], ref: str) -> Manifest:
    """The files of ``manifest`` whose path or file name matches a glob of ``patterns``;
    NothingSelected (naming a few paths) if none does."""
    patterns = list(patterns)
    if manifest.kind != "files":
        raise FormatError(f"{ref} holds a saved state, not files; --include selects files")
    kept = {
        path: entry
        for path, entry in manifest.files.items()
        if any(fnmatch.fnmatchcase(p, g) for g in patterns for p in (path, path.rsplit("/")[-1]))
    }
    if not kept:
        some = ", ".join(sorted(manifest.files)[:3]) + (", ..." if len(manifest.files) > 3 else "")
        raise NothingSelected(
            f"--include {' '.join(map(repr, patterns))} matches no file of {ref} (it holds {some})"
        )
    if manifest.meta.get("source") == "file":  # a single file stays one
        return manifest
    # A directory stays a directory, even with one file left.
    return replace(manifest, files=kept, meta={**manifest.meta, "source": "dir"})


def file_entry(manifest: Manifest, ref: str, path: str | None) -> FileEntry:
    """The entry of ``path`` in an ingested checkpoint (``None``: its only file)."""
    if manifest.kind != "files":
        raise FormatError(
            f"{ref} holds a state saved from Python, not files; "
            "`cas get REF out.safetensors --format safetensors` writes it as one"
        )
    if path is None:
        if len(manifest.files) == 1:
            return next(iter(manifest.files.values()))
        some = ", ".join(f"{ref}/{p}" for p in sorted(manifest.files)[:3])
        raise FormatError(f"{ref} holds {len(manifest.files)} files; name one ({some}, ...)")
    entry = manifest.files.get(path.strip("/"))
    if entry is None:
        raise NotFound(f"{ref} has no file {path!r}")
    return entry


Target = tuple[Path, tuple[str, ...], FileEntry]
"""Where one file goes: the directory it is written below, its path under it, its entry."""


def _check_targets(targets: list[Target], *, sha256: bool, overwrite: bool) -> None:
    """Refuse, before writing anything, what would fail half way or overwrite a user's file."""
    paths = [root.joinpath(*parts) for root, parts, _ in targets]
    names = {*paths}
    for (root, parts, _), target in zip(targets, paths, strict=True):
        if sha256 and len(os.fsencode(_sidecar_name(target.name))) > NAME_MAX:
            raise FormatError(
                f"{target.name[:40]}...: the name of its --sha256 sidecar would be longer than "
                f"{NAME_MAX} bytes; get it without --sha256"
            )
        for depth in range(1, len(parts)):
            inner = root.joinpath(*parts[:depth])
            if inner.is_symlink():
                raise AlreadyExists(f"{inner} is a symlink; cas get never writes through one")
            if not inner.is_dir() and (inner in names or inner.exists()):
                raise AlreadyExists(f"{inner} is a file where a directory is needed")
        if sha256 and _sidecar_of(target) in names:
            raise AlreadyExists(
                f"{_sidecar_of(target)} is a stored file and the --sha256 sidecar of {target.name}"
            )
    if not overwrite:
        outputs = [*paths, *(_sidecar_of(t) for t in paths)] if sha256 else paths
        clashes = [str(t) for t in outputs if os.path.lexists(t)]
        if clashes:
            raise AlreadyExists(f"{clashes[0]} exists (use --force to overwrite)")


def _sidecar_name(name: str) -> str:
    return name + ".sha256"


def _sidecar_of(target: Path) -> Path:
    return target.with_name(_sidecar_name(target.name))


@contextmanager
def _directory(root: Path, parts: tuple[str, ...]) -> Iterator[int]:
    """A descriptor of ``root/parts``, made as needed, reached without following a symlink
    below ``root``: a link planted there is refused rather than written through."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for depth, name in enumerate(parts):
            with suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=fd)
            try:
                inner = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                where = root.joinpath(*parts[: depth + 1])
                raise AlreadyExists(
                    f"{where} is a symlink or a file; cas get never writes through one"
                ) from e
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def restored_mode(entry: FileEntry) -> int:
    """The permission bits ``get`` gives a file: the recorded ones, never setuid, setgid or
    sticky (a store is not trusted to hand those out)."""
    return (entry.mode or 0o644) & 0o777


def _write_new(parent: int, name: str, data: bytes, mode: int) -> None:
    """Write ``name`` in the directory ``parent`` by temp file, fsync and rename."""
    _publish(parent, name, [data], mode, None)


def _publish(
    parent: int,
    name: str,
    blocks: Iterable[bytes | memoryview],
    mode: int,
    progress: Progress | None,
    mtime_ns: int | None = None,
) -> str:
    """Write ``blocks`` to a short-named temp file in ``parent``, fsync, rename it to ``name``
    (which replaces a link there, never writes through it); return the bytes' sha256.

    The temp name is short so that any name the filesystem takes can be restored.
    """
    tmp = f".cas-{uuid.uuid4().hex[:16]}.tmp"
    hasher = hashlib.sha256()
    fd = os.open(tmp, _NEW_FILE_FLAGS, 0o600, dir_fd=parent)
    try:
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                for data in blocks:
                    f.write(data)
                    hasher.update(data)
                    if progress is not None:
                        progress(len(data))
                f.flush()
                os.fsync(fd)
            os.fchmod(fd, mode)
            if mtime_ns is not None:  # the access time is now: the file was just written
                os.utime(fd, ns=(time.time_ns(), mtime_ns))
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=parent)
        raise
    return hasher.hexdigest()


def _write_file(
    io: ChunkIO, entry: FileEntry, parent: int, name: str, progress: Progress | None
) -> str:
    """Stream verified chunks into ``name`` in the directory ``parent``; return their sha256."""
    blocks = io.iter_chunks(entry.chunks)
    return _publish(parent, name, blocks, restored_mode(entry), progress, entry.mtime_ns)


def _sidecar_text(target: Path, hexdigest: str) -> bytes:
    return f"{hexdigest}  {target.name}\n".encode()


def write_sha256_sidecar(target: Path, hexdigest: str | None = None) -> Path:
    """Write ``target.sha256`` in GNU coreutils format (``sha256sum -c`` accepts it)."""
    if hexdigest is None:
        hasher = hashlib.sha256()
        with target.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                hasher.update(block)
        hexdigest = hasher.hexdigest()
    with _directory(target.parent, ()) as parent:
        _write_new(parent, _sidecar_name(target.name), _sidecar_text(target, hexdigest), 0o644)
    return _sidecar_of(target)


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
