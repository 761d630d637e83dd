"""Validating torch.save files as weights-only and locating their storages inside the zip.

Validation never unpickles and never imports torch: the pickle is read by an opcode scanner
(``cas.formats._pickle_scan``) that refuses any global outside the weights-only allowlist and
models what the allowed ones build, so nothing a file names is ever called. (``torch.load(...,
weights_only=True)`` is an unpickler that calls what passes its checks; those checks have had
holes, e.g. CVE-2025-32434.)

Storage offsets come from the zip's local file headers. Names, dtypes and shapes come from the
scanned pickle: each tensor rebuild names its storage key, offset, shape and stride, so a storage
that one plain contiguous tensor covers exactly becomes a region named by the tensor's dotted
path; other storages keep ``storage/<key>`` names and are described as bytes.
"""

from __future__ import annotations

import io
import os
import pickletools
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import IO, BinaryIO

from cas.errors import FormatError, RefusedPickle
from cas.formats._pickle_allow import PLAIN_DTYPES
from cas.formats._pickle_names import named_tensors
from cas.formats._pickle_scan import (
    BrokenPickle,
    ScannedPickle,
    UnsafePickle,
    scan_pickle,
)
from cas.formats.layout import (
    FileLayout,
    TensorRegion,
    first_overlap,
    opaque_layout,
    sorted_regions,
)

TORCH_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".ckpt"})
"""Names under which a zip or pickle that fails to validate is an error rather than opaque data."""

PICKLE_CAP = 1 << 30
"""Largest ``data.pkl`` accepted: real ones are kilobytes to a few megabytes."""

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
"""The first pickle of a legacy (non-zip) torch file; the protocol version follows."""

LEGACY_VERSION = 1001

_LOCAL_HEADER = struct.Struct("<4s2xHH2x2x4x4x4xHH")  # magic, flags, method, name len, extra len
_LOCAL_MAGIC = b"PK\x03\x04"
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError, EOFError, OSError)


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
    """Whether the file's opcodes read as one pickle up to its STOP (nothing is executed).

    Read through a file, never a mapping: a file truncated while it is mapped kills the reader
    with SIGBUS.
    """
    try:
        with open(name, "rb") as f:
            for _ in pickletools.genops(f):
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
    try:
        scanned: ScannedPickle | None = _scan_data_pkl(name, archive, infos, prefix)
    except FormatError:
        if not allow_opaque_pickles:
            raise
        # Consent to keep the pickle as bytes never loaded: its tensor storages are still cut
        # at their boundaries, named by a scan that models foreign objects as opaque markers.
        scanned = _scan_foreign(archive, infos, prefix)
        if scanned is _TORCHSCRIPT:
            return opaque_layout(size)
    try:
        members = _data_members(name, stream, infos, prefix, size)
        if scanned is not None:
            _check_storages(name, scanned, members)
    except FormatError:
        if allow_opaque_pickles:
            return opaque_layout(size)
        raise
    if _byteorder(name, archive, prefix) != "little":
        # Storage bytes are big-endian, so they never equal a tensor's little-endian bytes.
        return FileLayout(format="torch-zip", size=size)

    described = {} if scanned is None else _describe_storages(scanned, members)
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
        with open(name, "rb") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise FormatError(f"{name} changed while it was being read")
            _check_legacy(name, f, size)
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


def _scan(name: str, stream: IO[bytes], *, storage_id_fields: int) -> ScannedPickle:
    """``scan_pickle`` with its refusals turned into one-line ``FormatError``s naming the file."""
    try:
        return scan_pickle(stream, storage_id_fields=storage_id_fields)
    except UnsafePickle as e:
        raise RefusedPickle(name, "not a weights-only checkpoint", str(e)) from None
    except BrokenPickle as e:
        raise _not_loadable(name, str(e)) from None


def _not_loadable(name: str, reason: str) -> FormatError:
    return RefusedPickle(name, "not a loadable torch checkpoint", reason)


def _scan_data_pkl(
    name: str, archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo], prefix: str
) -> ScannedPickle:
    if any(i.filename == f"{prefix}/constants.pkl" for i in infos):
        raise _not_loadable(name, "a TorchScript archive, not a torch.save checkpoint")
    pkl = next(i for i in infos if i.filename == f"{prefix}/data.pkl")
    if pkl.file_size > PICKLE_CAP:
        raise FormatError(f"{name}: data.pkl of {pkl.file_size} bytes exceeds the 1 GiB cap")
    try:
        data = archive.read(pkl)
    except _ZIP_ERRORS as e:
        raise _not_loadable(name, f"data.pkl is unreadable: {type(e).__name__}: {e}") from e
    return _scan(name, io.BytesIO(data), storage_id_fields=5)


_TORCHSCRIPT = ScannedPickle(None, {})
"""``_scan_foreign``'s answer for a TorchScript archive, which stays opaque."""


def _scan_foreign(
    archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo], prefix: str
) -> ScannedPickle | None:
    """``data.pkl`` scanned with foreign objects modelled as opaque; None if even that fails
    (then the storages keep ``storage/<key>`` names)."""
    if any(i.filename == f"{prefix}/constants.pkl" for i in infos):
        return _TORCHSCRIPT
    pkl = next(i for i in infos if i.filename == f"{prefix}/data.pkl")
    if pkl.file_size > PICKLE_CAP:
        return None
    try:
        data = archive.read(pkl)
        return scan_pickle(io.BytesIO(data), storage_id_fields=5, foreign_objects=True)
    except (UnsafePickle, BrokenPickle, *_ZIP_ERRORS):
        return None


def _check_storages(name: str, scanned: ScannedPickle, members: list[_Member]) -> None:
    """Every storage the pickle names is a record of exactly its size, as torch.load needs."""
    by_key = {m.key: m for m in members}
    for storage in scanned.storages.values():
        member = by_key.get(storage.key)
        if member is None:
            raise _not_loadable(name, f"its pickle names storage {storage.key!r}, which is missing")
        if member.nbytes != storage.nbytes:
            raise _not_loadable(
                name,
                f"record data/{storage.key} holds {member.nbytes} bytes, "
                f"its pickle says {storage.nbytes}",
            )


def _check_legacy(name: str, stream: BinaryIO, size: int) -> None:
    """A legacy file: magic, version, system info and object pickles, a key list, raw storages.

    Read through the file (a mapping of a file truncated meanwhile would end in SIGBUS).
    """
    magic = _scan(name, stream, storage_id_fields=6).root
    if type(magic) is not int or magic != LEGACY_MAGIC:
        raise _not_loadable(name, "a pickle without torch's magic number")
    version = _scan(name, stream, storage_id_fields=6).root
    if type(version) is not int or version != LEGACY_VERSION:
        raise _not_loadable(name, f"unknown legacy format version {version!r:.40}")
    _scan(name, stream, storage_id_fields=6)  # system info: byte order and type sizes
    storages = _scan(name, stream, storage_id_fields=6).storages
    keys = _scan(name, stream, storage_id_fields=6).root
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise _not_loadable(name, "its storage key list is not a list of names")
    offset = stream.tell()
    for key in keys:
        storage = storages.get(key)
        if storage is None:
            raise _not_loadable(name, f"storage {key[:80]!r} is listed but never used")
        stream.seek(offset)
        numel = int.from_bytes(stream.read(8), "little", signed=True)
        if offset + 8 > size or numel != storage.numel:
            raise _not_loadable(name, f"storage {key[:80]!r} is truncated or has the wrong size")
        offset += 8 + storage.nbytes
    if offset > size:
        raise _not_loadable(name, "the file ends inside its storages")


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


def _describe_storages(scanned: ScannedPickle, members: list[_Member]) -> dict[str, TensorRegion]:
    """Region per member key for storages that one tensor covers exactly, named after it.

    Tensors are visited depth-first in the saved object's order; the first with a path that
    covers a storage names it (a tied weight's second name, views and transposes do not).
    """
    by_key = {m.key: m for m in members}
    described: dict[str, TensorRegion] = {}
    used_names: set[str] = set()
    for path, tensor in named_tensors(scanned.root):
        member = by_key.get(tensor.storage.key)
        if member is None or member.key in described or not path or path in used_names:
            continue
        if tensor.covers_storage() and tensor.dtype in PLAIN_DTYPES:
            region = TensorRegion(path, tensor.dtype, tensor.shape, member.offset, member.nbytes)
            described[member.key] = region
            used_names.add(path)
    return described
