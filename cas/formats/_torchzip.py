"""Validating torch.save files as weights-only and locating their storages inside the zip.

Validation is ``torch.load(weights_only=True)``: torch's restricted unpickler refuses any global
outside its allowlist before calling it, so a malicious ``__reduce__`` never runs. The only
globals added to that allowlist are numpy's array and dtype constructors, the same ones
``transformers`` allows for ``rng_state.pth``; objects built from them are plain data.

Storage offsets come from the zip's local file headers, not from torch. Names, dtypes and shapes
come from the loaded object: with ``mmap=True`` every storage is a slice of one mapping of the
whole file, so ``storage.data_ptr() - base`` is the storage's file offset. Nothing here depends
on torch internals; if the pointers cannot be matched to members, regions keep their
``storage/<key>`` names and stay correct.
"""

from __future__ import annotations

import contextlib
import pickle
import pickletools
import re
import struct
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from cas.errors import FormatError
from cas.formats.layout import (
    FileLayout,
    TensorRegion,
    first_overlap,
    opaque_layout,
    sorted_regions,
)

if TYPE_CHECKING:
    import torch

TORCH_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".ckpt"})
"""Names under which a zip or pickle that fails to load is an error rather than opaque data."""

PICKLE_CAP = 1 << 30
"""Largest ``data.pkl`` accepted: real ones are kilobytes to a few megabytes."""

LEGACY_CAP = 1 << 30
"""Largest legacy (non-zip) torch file validated: torch reads those wholly into memory."""

_LOCAL_HEADER = struct.Struct("<4s2xHH2x2x4x4x4xHH")  # magic, flags, method, name len, extra len
_LOCAL_MAGIC = b"PK\x03\x04"
_HINT = "--allow-opaque-pickles (allow_opaque_pickles=True) stores it as opaque bytes, never loaded"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class _Member:
    key: str
    offset: int
    nbytes: int
    stored: bool


def is_pickle_head(head: bytes) -> bool:
    """True if ``head`` starts with a pickle PROTO opcode of a protocol torch can write."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def parses_as_pickle(name: str) -> bool:
    """Whether the file's opcodes read as one pickle up to its STOP (nothing is executed)."""
    try:
        with open(name, "rb") as stream:
            for _ in pickletools.genops(stream):
                pass
    except Exception:  # pickletools raises ValueError and others on what is not a pickle
        return False
    return True


def inspect_torch_zip(
    name: str, stream: BinaryIO, size: int, *, strict: bool, allow_opaque_pickles: bool
) -> FileLayout:
    """Layout of a zip file: torch-zip if it holds ``<archive>/data.pkl``, else opaque.

    ``strict`` (a torch-like file name) turns an unreadable zip into ``FormatError``.
    """
    try:
        archive = zipfile.ZipFile(stream)
        infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as e:
        if strict:
            raise FormatError(f"{name}: corrupt zip archive: {e}") from e
        return opaque_layout(size)
    prefix = _archive_prefix(infos)
    if prefix is None:
        return opaque_layout(size)
    pkl = next(i for i in infos if i.filename == f"{prefix}/data.pkl")
    try:
        if pkl.file_size > PICKLE_CAP:
            raise FormatError(f"{name}: data.pkl of {pkl.file_size} bytes exceeds the 1 GiB cap")
        loaded = _load_weights_only(name, mmap=True)
    except FormatError:
        if allow_opaque_pickles:
            return opaque_layout(size)
        raise
    members = _data_members(name, stream, infos, prefix, size)
    if _byteorder(name, archive, prefix) != "little":
        # Storage bytes are big-endian, so they never equal a tensor's little-endian bytes.
        return FileLayout(format="torch-zip", size=size)

    described = _describe_storages(loaded, members)
    del loaded  # drops the file mapping
    regions: list[TensorRegion] = []
    for member in members:
        if not member.stored:
            continue  # compressed bytes are not the tensor's bytes
        fallback = TensorRegion(
            f"storage/{member.key}", "uint8", (member.nbytes,), member.offset, member.nbytes
        )
        regions.append(described.get(member.key, fallback))
    return FileLayout(format="torch-zip", size=size, regions=sorted_regions(regions))


def inspect_pickle(name: str, size: int, *, allow_opaque_pickles: bool) -> FileLayout:
    """Validate a legacy torch file (or any pickle) as weights-only; its bytes stay opaque."""
    try:
        if size > LEGACY_CAP:
            raise FormatError(
                f"{name}: legacy (non-zip) torch file of {size} bytes is too large to validate; "
                "re-save it with torch.save"
            )
        _load_weights_only(name, mmap=False)
    except FormatError:
        if allow_opaque_pickles:
            return opaque_layout(size)
        raise
    return opaque_layout(size)


def _archive_prefix(infos: list[zipfile.ZipInfo]) -> str | None:
    # torch's reader takes the archive name from the first record, so do the same.
    if not infos or "/" not in infos[0].filename:
        return None
    prefix = infos[0].filename.split("/", 1)[0]
    if not any(i.filename == f"{prefix}/data.pkl" for i in infos):
        return None
    return prefix


def _load_weights_only(name: str, *, mmap: bool) -> object:
    import torch

    with warnings.catch_warnings(), _numpy_safe_globals():
        warnings.simplefilter("ignore")
        try:
            return torch.load(name, weights_only=True, mmap=mmap, map_location="cpu")
        except pickle.UnpicklingError as e:
            raise FormatError(
                f"refusing to load {name}: not a weights-only checkpoint ({_reason(e)}); {_HINT}"
            ) from e
        except Exception as e:  # torch raises many types for damaged or TorchScript files
            raise FormatError(
                f"refusing to load {name}: not a loadable torch checkpoint ({_reason(e)}); {_HINT}"
            ) from e


def _numpy_safe_globals() -> contextlib.AbstractContextManager[object]:
    import numpy as np
    import torch

    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:  # torch 2.4: only a process-wide allowlist exists
        return contextlib.nullcontext()
    core = getattr(np, "_core", None) or np.core
    numeric = "?bhilqBHILQefdFD"
    allowed: list[object] = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    allowed += [type(np.dtype(code)) for code in numeric]
    # Files written under numpy 1.x name the reconstructor by its old module path.
    allowed.append((core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"))
    manager: contextlib.AbstractContextManager[object] = safe_globals(allowed)
    return manager


def _reason(error: BaseException) -> str:
    # torch's messages are paragraphs of advice; keep the one that names the problem.
    paragraphs = [p.strip() for p in _ANSI.sub("", str(error)).split("\n\n") if p.strip()]
    boilerplate = ("Weights only load failed", "Check the documentation", "Please file an issue")
    useful = [p for p in paragraphs if not p.startswith(boilerplate)] or paragraphs or [repr(error)]
    text = " ".join(useful[0].split())
    return text if len(text) <= 200 else text[:197] + "..."


def _data_members(
    name: str, stream: BinaryIO, infos: list[zipfile.ZipInfo], prefix: str, size: int
) -> list[_Member]:
    data_dir = f"{prefix}/data/"
    members: list[_Member] = []
    for info in infos:
        key = info.filename[len(data_dir) :]
        if not info.filename.startswith(data_dir) or not key or "/" in key:
            continue
        stream.seek(info.header_offset)
        header = stream.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size:
            raise FormatError(f"{name}: zip local header of {info.filename} is truncated")
        magic, flags, method, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        if magic != _LOCAL_MAGIC:
            raise FormatError(f"{name}: zip local header of {info.filename} is corrupt")
        # The central directory's extra field differs from the local one (torch pads the local
        # extra field to align storages), so the data offset must come from the local header.
        offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if offset + info.compress_size > size:
            raise FormatError(f"{name}: zip member {info.filename} runs past the end of the file")
        stored = (
            info.compress_type == zipfile.ZIP_STORED
            and method == zipfile.ZIP_STORED
            and not flags & 0x1  # encrypted
            and info.compress_size == info.file_size
        )
        members.append(_Member(key, offset, info.file_size, stored))

    spans = sorted_regions(
        [TensorRegion(m.key, "uint8", (), m.offset, m.nbytes) for m in members if m.stored]
    )
    overlap = first_overlap(spans)
    if overlap is not None:
        raise FormatError(
            f"{name}: zip members data/{overlap[0].name} and data/{overlap[1].name} overlap"
        )
    return members


def _byteorder(name: str, archive: zipfile.ZipFile, prefix: str) -> str:
    info = next((i for i in archive.infolist() if i.filename == f"{prefix}/byteorder"), None)
    if info is None:
        return "little"  # older torch wrote no marker; it loads those as native (little)
    if info.file_size > 16:
        raise FormatError(f"{name}: zip member {info.filename} is implausibly large")
    try:
        return archive.read(info).decode("ascii", errors="replace").strip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise FormatError(f"{name}: zip member {info.filename} is unreadable: {e}") from e


def _walk_tensors(root: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors reachable from a loaded object with their dotted paths, depth-first in order."""
    import torch

    stack: list[tuple[tuple[str, ...], object]] = [((), root)]
    seen: set[int] = set()
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            yield ".".join(path), obj
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        children: list[tuple[str, object]]
        if isinstance(obj, dict):
            children = [(str(k), v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple)):
            children = [(str(i), v) for i, v in enumerate(obj)]
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            children = [(str(k), v) for k, v in vars(obj).items()]  # allowlisted user classes
        else:
            continue
        stack.extend(((*path, key), value) for key, value in reversed(children))


def _describe_storages(loaded: object, members: list[_Member]) -> dict[str, TensorRegion]:
    """Region per member key for storages that one tensor covers exactly, named after it."""
    storages: list[tuple[int, int]] = []  # (data_ptr, nbytes)
    tensors: list[tuple[str, torch.Tensor, int]] = []
    for path, tensor in _walk_tensors(loaded):
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue  # sparse, nested or other storage-less layouts keep fallback names
        if storage.device.type != "cpu":
            continue
        storages.append((storage.data_ptr(), storage.nbytes()))
        tensors.append((path, tensor, storage.data_ptr()))

    member_at = _match_storages(storages, members)
    described: dict[str, TensorRegion] = {}
    used_names: set[str] = set()
    for path, tensor, ptr in tensors:
        member = member_at.get(ptr)
        if member is None or member.key in described or not path or path in used_names:
            continue
        covers = (
            tensor.storage_offset() == 0
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
            and tensor.numel() * tensor.element_size() == member.nbytes
        )
        if covers:
            dtype = str(tensor.dtype).removeprefix("torch.")
            shape = tuple(tensor.shape)
            described[member.key] = TensorRegion(path, dtype, shape, member.offset, member.nbytes)
            used_names.add(path)
    return described


def _match_storages(storages: list[tuple[int, int]], members: list[_Member]) -> dict[int, _Member]:
    """Map storage data pointers to members by finding the mapping's base address.

    Every storage is ``base + member.offset``; try the bases that explain the lowest pointer
    and keep the first one under which every storage lands on a member of its size.
    """
    if not storages or not members:
        return {}
    by_offset = {m.offset: m for m in members}
    lowest_ptr, lowest_size = min(storages)
    candidates = [lowest_ptr - min(by_offset)]
    candidates += [lowest_ptr - m.offset for m in members if m.nbytes == lowest_size]
    for base in dict.fromkeys(candidates[:256]):
        matched: dict[int, _Member] = {}
        for ptr, nbytes in storages:
            member = by_offset.get(ptr - base)
            if member is None or member.nbytes != nbytes:
                break
            matched[ptr] = member
        else:
            return matched
    return {}
