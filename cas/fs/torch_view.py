"""Synthesized ``torch.load``-able views of a saved state: ``<key>.pt`` per top-level entry.

The file is the zip that ``torch.save(state[key], f)`` writes: ``archive/data.pkl`` (protocol 2,
tensors rebuilt by ``torch._utils._rebuild_tensor_v3`` from untyped storages, which
``torch.load(weights_only=True)`` accepts), ``.format_version``, ``.storage_alignment``,
``byteorder``, one stored (uncompressed) ``data/<n>`` member per tensor aligned to 64 bytes,
``version`` and ``.data/serialization_id``, with zip64 records where sizes or offsets need them.
``torch.load`` gives back the entry as ``Repository.load`` does: nested dicts, lists, tuples,
plain values and tensors, tied tensors still tied.

Every zip header is computed from dtypes and shapes, and each ``data/<n>`` member maps onto the
tensor's chunks, so the bytes never vary and nothing is read to list or ``stat`` the file. The
one departure from ``torch.save``: tensor members carry CRC-32 0, because a CRC would need every
tensor byte before the first header byte could be served. ``torch.load`` does not check member
CRCs (as with ``torch.serialization.set_crc32_options(False)``), but ``unzip -t`` reports them.
Entries holding numpy arrays get no ``.pt`` view (``weights_only`` loading refuses numpy).
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from collections import OrderedDict
from typing import Any

from cas.digest import Digest
from cas.errors import FormatError
from cas.fs.extents import Extent, FileView, chunk_extents
from cas.model.manifest import TensorEntry
from cas.model.state import decode_state, iter_tensor_paths, torch_dtype

_ARCHIVE = "archive"
_ALIGN = 64
_U32 = 0xFFFFFFFF
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, so the bytes never depend on a clock


class _Storage:
    """Stands for tensor ``key``'s bytes; the pickler writes it as a persistent id."""

    def __init__(self, key: str, nbytes: int) -> None:
        self.key = key
        self.nbytes = nbytes


class _Tensor:
    """Pickles as the call ``torch.save`` uses to rebuild a tensor of this dtype and shape."""

    def __init__(self, storage: _Storage, entry: TensorEntry) -> None:
        self.storage = storage
        self.shape = tuple(entry.shape)
        self.dtype = torch_dtype(entry.dtype)

    def __reduce__(self) -> tuple[Any, ...]:
        import torch  # the pickle names torch's own rebuild function, so it needs torch's object

        stride = []
        step = 1
        for dim in reversed(self.shape):
            stride.append(step)
            step *= max(dim, 1)
        args: tuple[Any, ...] = (
            self.storage,
            0,
            self.shape,
            tuple(reversed(stride)),
            False,
            OrderedDict(),
            self.dtype,
        )
        return (torch._utils._rebuild_tensor_v3, args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            import torch

            return ("storage", torch.storage.UntypedStorage, obj.key, "cpu", obj.nbytes)
        return None


def torch_view(node: Any, tensors: tuple[TensorEntry, ...], digest: Digest) -> FileView | None:
    """The ``.pt`` view of one entry of a state tree, or None if it cannot have one."""
    used = sorted(
        {index for _, index in iter_tensor_paths(node)}, key=lambda i: _first_use(node, i)
    )
    if any(tensors[i].kind != "torch" for i in used):
        return None
    storages = {index: _Storage(str(n), tensors[index].nbytes) for n, index in enumerate(used)}
    buffer = io.BytesIO()
    try:
        stubs = {index: _Tensor(storages[index], tensors[index]) for index in used}
        # The view is of the stored bytes: a tensor stored as float16 reads as float16 here.
        _Pickler(buffer, protocol=2).dump(
            decode_state(node, stubs.__getitem__, restore_dtypes=False)
        )
    except FormatError:
        return None  # a dtype this torch does not know: no torch view of this entry
    records: list[tuple[str, bytes | TensorEntry]] = [
        ("data.pkl", buffer.getvalue()),
        (".format_version", b"1"),
        (".storage_alignment", str(_ALIGN).encode()),
        ("byteorder", b"little"),
        *((f"data/{storages[i].key}", tensors[i]) for i in used),
        ("version", b"3\n"),
        (".data/serialization_id", str(int(digest[:32], 16)).zfill(40)[-40:].encode()),
    ]
    return _zip_view(records)


def _first_use(node: Any, index: int) -> int:
    for position, (_, i) in enumerate(iter_tensor_paths(node)):
        if i == index:
            return position
    return 0


def _zip_view(records: list[tuple[str, bytes | TensorEntry]]) -> FileView:
    extents: list[Extent] = []
    central: list[bytes] = []
    offset = 0
    for name, content in records:
        full = f"{_ARCHIVE}/{name}".encode()
        size = len(content) if isinstance(content, bytes) else content.nbytes
        crc = zlib.crc32(content) if isinstance(content, bytes) else 0
        big = size >= _U32
        zip64 = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        fixed = 30 + len(full) + len(zip64) + 4
        pad = -(offset + fixed) % _ALIGN
        extra = zip64 + struct.pack("<HH", 0x4246, pad) + bytes(pad)  # 'FB' padding, as torch
        sizes = (_U32, _U32) if big else (size, size)
        local = (
            struct.pack(
                "<4sHHHHHIIIHH",
                b"PK\x03\x04",
                45 if big else 20,
                0,
                0,
                0,
                _DOS_DATE,
                crc,
                *sizes,
                len(full),
                len(extra),
            )
            + full
            + extra
        )
        extents.append(Extent(offset, len(local), data=local))
        data_start = offset + len(local)
        if isinstance(content, bytes):
            if content:
                extents.append(Extent(data_start, size, data=content))
        elif content.inline is not None:
            if size:
                extents.append(Extent(data_start, size, data=content.inline))
        else:
            extents.extend(chunk_extents(content.chunks, data_start))
        central.append(_central_record(full, crc, size, offset))
        offset = data_start + size
    directory = b"".join(central)
    tail = _end_records(len(records), offset, len(directory))
    extents.append(Extent(offset, len(directory) + len(tail), data=directory + tail))
    return FileView(offset + len(directory) + len(tail), tuple(extents), 0o444)


def _central_record(name: bytes, crc: int, size: int, offset: int) -> bytes:
    fields = []
    if size >= _U32:
        fields += [size, size]
    if offset >= _U32:
        fields.append(offset)
    zip64 = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
    sizes = (_U32, _U32) if size >= _U32 else (size, size)
    version = 45 if fields else 20
    return (
        struct.pack(
            "<4sHHHHHHIIIHHHHHII",
            b"PK\x01\x02",
            version,
            version,
            0,
            0,
            0,
            _DOS_DATE,
            crc,
            *sizes,
            len(name),
            len(zip64),
            0,
            0,
            0,
            0,
            min(offset, _U32),
        )
        + name
        + zip64
    )


def _end_records(count: int, directory_offset: int, directory_size: int) -> bytes:
    needs64 = count >= 0xFFFF or directory_offset >= _U32 or directory_size >= _U32
    out = b""
    if needs64:
        end64_offset = directory_offset + directory_size
        out += struct.pack(
            "<4sQHHIIQQQQ",
            b"PK\x06\x06",
            44,
            45,
            45,
            0,
            0,
            count,
            count,
            directory_size,
            directory_offset,
        )
        out += struct.pack("<4sIQI", b"PK\x06\x07", 0, end64_offset, 1)
    out += struct.pack(
        "<4sHHHHIIH",
        b"PK\x05\x06",
        0,
        0,
        min(count, 0xFFFF),
        min(count, 0xFFFF),
        min(directory_size, _U32),
        min(directory_offset, _U32),
        0,
    )
    return out
