"""Lazy, partial reads of one checkpoint: ``Repository.open(ref)``, in the manner of safetensors'
``safe_open``.

Opening reads the manifest only. ``reader["model.w"]`` reads that tensor's chunks and nothing
else; ``reader.get_slice("model.w")[a:b]`` reads only the chunks that cover rows ``a`` to ``b``:
tensors are cut into fixed-size chunks aligned to their first byte, so the byte range of a run of
rows names its chunks without reading any. Memory stays bounded by what is returned (plus, for a
slice, at most the two part-used chunks at its ends, which are dropped before returning).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from cas.errors import CASError, NotFound
from cas.model.limits import ReadLimits
from cas.model.manifest import ITEMSIZE, ChunkRef, Manifest, TensorEntry
from cas.model.state import (
    buffer_over,
    byte_buffer,
    decode_state,
    iter_tensor_paths,
    tensor_casts,
    tensor_from_bytes,
    torch_dtype,
    writable_view,
)
from cas.objects.chunkio import ChunkIO


class _TensorSource(Protocol):
    """What a reader needs of a ``Repository``."""

    read_limits: ReadLimits
    io: ChunkIO

    def manifest(self, spec: str) -> Manifest: ...

    def read_tensors(self, manifest: Manifest, indices: Iterable[int]) -> dict[int, Any]: ...


class ClosedCheckpoint(CASError):
    """A tensor was asked of a checkpoint reader after its ``with`` block ended."""


class CheckpointReader(Mapping[str, Any]):
    """A read-only mapping from a checkpoint's tensor paths to tensors, read on demand.

    Keys are the dotted paths ``load(keys=...)`` matches (``model.w``; for ingested files
    ``<file>.<tensor>``). ``metadata`` is the manifest's (step, metrics, message...).
    """

    def __init__(self, repo: _TensorSource, ref: str) -> None:
        self._repo = repo
        self.ref = ref
        self.manifest: Manifest = repo.manifest(ref)
        self._index = _tensor_index(self.manifest)
        self._casts = tensor_casts(self.manifest.tree) if self.manifest.kind == "state" else {}
        self._closed = False

    @property
    def metadata(self) -> dict[str, Any]:
        """The checkpoint's metadata (a copy)."""
        return dict(self.manifest.meta)

    def plain_values(self) -> Any:
        """The saved state with its tensors left out (step, config, counters...); reads nothing."""
        if self.manifest.kind == "files":
            return {}
        tensors = set(self._index)
        return decode_state(self.manifest.tree, _no_tensor, lambda path: path not in tensors)

    def __getitem__(self, name: str) -> Any:
        """The whole tensor ``name``, reading only its chunks."""
        index = self._lookup(name)
        return self._restored(index, self._repo.read_tensors(self.manifest, [index])[index])

    def _restored(self, index: int, value: Any) -> Any:
        """``value`` in the dtype it was saved in, if a precision policy stored it in another."""
        cast = self._casts.get(index)
        return value if cast is None else value.to(torch_dtype(cast))

    def get_tensor(self, name: str) -> Any:
        """``reader[name]``, under safetensors' name for it."""
        return self[name]

    def get_slice(self, name: str) -> TensorSlice:
        """A handle whose ``[rows]`` (and ``[rows, ...]``) reads only the chunks of those rows."""
        index = self._lookup(name)
        return TensorSlice(self, name, index, self.manifest.tensors[index])

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def close(self) -> None:
        """End reading; later reads raise ``ClosedCheckpoint`` (the store stays open)."""
        self._closed = True

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<CheckpointReader {self.ref}: {len(self)} tensors>"

    def _lookup(self, name: str) -> int:
        if self._closed:
            raise ClosedCheckpoint(f"the reader of {self.ref} is closed")
        index = self._index.get(name)
        if index is None:
            raise NotFound(f"{self.ref} has no tensor {name!r} (it has {len(self)}; see keys())")
        return index

    def _read_bytes(self, entry: TensorEntry, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of a tensor as a flat uint8 tensor, reading only their chunks."""
        if self._closed:
            raise ClosedCheckpoint(f"the reader of {self.ref} is closed")
        self._repo.read_limits.check([end - start])
        if entry.inline is not None:
            return buffer_over(bytearray(entry.inline[start:end]))
        chosen: list[ChunkRef] = []
        first = offset = 0
        for chunk in entry.chunks:
            if offset < end and offset + chunk.size > start:
                if not chosen:
                    first = offset
                chosen.append(chunk)
            offset += chunk.size
            if offset >= end:
                break
        buffer = byte_buffer(sum(c.size for c in chosen))
        if chosen:
            encoded = {0} if entry.encoding else set()
            self._repo.io.read_all([(chosen, writable_view(buffer))], encoded=encoded)
        if start == first and len(buffer) == end - start:
            return buffer
        return buffer[start - first : end - first].clone()  # drop the end chunks' other bytes


class TensorSlice:
    """One tensor of an open checkpoint, read by rows: ``slice[a:b]``, ``slice[i]``,
    ``slice[a:b:step, cols]``. Steps must be positive, as in torch."""

    def __init__(self, reader: CheckpointReader, name: str, index: int, entry: TensorEntry) -> None:
        self._reader = reader
        self.name = name
        self._index = index
        self._entry = entry

    def get_shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        """The tensor's dtype name as it loads (``float32``, ``bfloat16``, a numpy ``<f4``...)."""
        return self._reader._casts.get(self._index, self._entry.dtype)

    def __getitem__(self, key: Any) -> Any:
        entry = self._entry
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) and key else (key, ())
        if not entry.shape or first is Ellipsis:
            whole = self._reader[self.name]
            return whole[key] if entry.shape else whole
        rows = entry.shape[0]
        row_bytes = math.prod(entry.shape[1:]) * _itemsize(entry)
        if isinstance(first, slice):
            picked = range(*first.indices(rows))
            if first.step is not None and first.step <= 0:
                raise ValueError("get_slice: the step of a row slice must be positive")
        elif isinstance(first, int):
            row = first + rows if first < 0 else first
            if not 0 <= row < rows:
                raise IndexError(f"row {first} is out of range for {self.name} of {rows} rows")
            picked = range(row, row + 1)
        else:
            raise TypeError(
                f"get_slice takes ints and slices over rows, not {type(first).__name__}"
            )
        low = picked[0] if picked else 0
        high = picked[-1] + 1 if picked else 0
        data = self._reader._read_bytes(entry, low * row_bytes, high * row_bytes)
        block = tensor_from_bytes(entry.kind, entry.dtype, (high - low, *entry.shape[1:]), data)
        block = self._reader._restored(self._index, block)
        if picked.step != 1:
            block = block[:: picked.step]
        if isinstance(first, int):
            return block[0][rest] if rest else block[0]
        return block[(slice(None), *rest)] if rest else block


def _no_tensor(index: int) -> Any:
    raise AssertionError(f"tensor {index} was selected for a read of plain values")


def _itemsize(entry: TensorEntry) -> int:
    if entry.kind == "torch":
        return ITEMSIZE[entry.dtype]
    import numpy as np

    return int(np.dtype(entry.dtype).itemsize)


def _tensor_index(manifest: Manifest) -> dict[str, int]:
    """Every tensor's path and its index in the manifest's table."""
    if manifest.kind == "files":
        return {
            f"{path}.{region.name}": region.tensor_index
            for path, entry in manifest.files.items()
            for region in entry.regions
        }
    return dict(iter_tensor_paths(manifest.tree))
