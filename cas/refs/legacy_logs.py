"""Readers for the layouts append-only records had before append logs, so old stores stay readable.

Three layouts predate ``cas.refs.log`` (docs/format.md describes each):

- a training history ref naming a manifest with meta ``format: "cas-history"``, version 1, whose
  tensors are byte segments (uint8 entries, inline or chunked), each a msgpack list of records;
- an opponent pool's eviction ref naming a manifest with meta ``cas_pool_evictions: 1`` whose
  meta ``log`` is the whole list of records;
- an eviction log kept outside refs, as JSON-lines blobs ``state/eviction-log/<name>/<YYYY-MM>.jsonl``.

They are only read here; the next append rewrites the first two in the append-log layout, and the
third is read before the log that replaced it.
"""

from __future__ import annotations

import json
from typing import Any

from cas.blobstore.base import BlobStore
from cas.errors import FormatError, NotFound
from cas.model.bounded import unpack_bounded
from cas.model.manifest import Manifest, TensorEntry
from cas.objects.store import ObjectStore

HISTORY_FORMAT = "cas-history"
HISTORY_VERSION = 1
MAX_LEGACY_SEGMENT = 256 << 20
JSONL_PREFIX = "state/eviction-log/"
"""Where eviction logs lived before they were append logs."""


def legacy_records(manifest: Manifest, kind: str, objects: ObjectStore) -> list[Any] | None:
    """The records of a head in a layout older than append logs, if it is one of ``kind``'s."""
    if kind == "training-history" and manifest.meta.get("format") == HISTORY_FORMAT:
        return _history_records(manifest, objects)
    if kind == "pool-evictions" and manifest.meta.get("cas_pool_evictions") == 1:
        log = manifest.meta.get("log", [])
        if not isinstance(log, list) or not all(isinstance(item, dict) for item in log):
            raise FormatError("the pool's eviction log is not a list of records")
        return log
    return None


def _history_records(manifest: Manifest, objects: ObjectStore) -> list[Any]:
    version = manifest.meta.get("version")
    if version != HISTORY_VERSION:
        raise FormatError(f"training history has unsupported version {version!r}")
    records: list[Any] = []
    for entry in manifest.tensors:
        records.extend(_decode_history_segment(_entry_bytes(entry, objects)))
    expected = manifest.meta.get("records")
    if expected != len(records):
        raise FormatError(
            f"training history holds {len(records)} records, its head says {expected}"
        )
    return records


def _entry_bytes(entry: TensorEntry, objects: ObjectStore) -> bytes:
    """A byte segment's bytes, each chunk verified on read."""
    if entry.dtype != "uint8" or entry.encoding:
        raise FormatError("a training history segment is not a plain byte tensor")
    if entry.nbytes > MAX_LEGACY_SEGMENT:
        raise FormatError("training history segment too large")
    if entry.inline is not None:
        return entry.inline
    return b"".join(bytes(objects.get_chunk(chunk.digest)) for chunk in entry.chunks)


def _decode_history_segment(data: bytes) -> list[Any]:
    records = unpack_bounded(data, "training history segment", max_depth=64)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise FormatError("training history segment is not a list of records")
    return records


def jsonl_records(blobs: BlobStore, name: str) -> list[dict[str, Any]]:
    """Every record of the old-layout eviction log ``name``, oldest month first, in append order."""
    prefix = f"{JSONL_PREFIX}{name}/"
    records: list[dict[str, Any]] = []
    for key in sorted(blobs.list(prefix)):
        try:
            data = blobs.get(key)
        except NotFound:
            continue
        records.extend(_parse_lines(data, key))
    return records


def jsonl_names(blobs: BlobStore) -> set[str]:
    """Names of the eviction logs kept in the old layout."""
    return {key[len(JSONL_PREFIX) :].split("/", 1)[0] for key in blobs.list(JSONL_PREFIX)}


def delete_jsonl(blobs: BlobStore, name: str) -> int:
    """Delete the old-layout eviction log ``name`` (once a log holds its records); return how
    many blobs went."""
    deleted = 0
    for key in sorted(blobs.list(f"{JSONL_PREFIX}{name}/")):
        try:
            blobs.delete(key)
        except NotFound:
            continue
        deleted += 1
    return deleted


def _parse_lines(data: bytes, key: str) -> list[dict[str, Any]]:
    out = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise FormatError(f"eviction log {key!r} line {number} is not JSON: {e}") from e
        if isinstance(record, dict):
            out.append(record)
    return out
