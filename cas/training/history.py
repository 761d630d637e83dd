"""Training history: an append-only log of per-step records under one ref that survives restarts.

ANDREA's rule: the loss history is never archived or reset, across restarts, resumes and policy
changes. Here it is a ref (``runs/<id>/history`` by default) naming a manifest whose tensors are
*segments*: msgpack-encoded lists of records. Appending stores the new records and moves the ref by
compare-and-swap, so two writers never lose each other's records. Sealed segments are chunks that
every later version of the history shares; only a small tail (below ``TAIL_MAX`` bytes) is kept
inline in the manifest and rewritten, so an append costs O(new records), not O(history).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import torch

from cas.digest import Digest
from cas.errors import FormatError, RefConflict
from cas.model.manifest import Manifest, TensorEntry
from cas.model.state import TensorSource

if TYPE_CHECKING:
    from cas.repo.repository import Repository

HISTORY_FORMAT = "cas-history"
HISTORY_VERSION = 1
TAIL_MAX = 64 << 10
"""An inline tail larger than this is sealed into a chunked segment."""
MAX_SEGMENT_BYTES = 256 << 20
CAS_RETRIES = 32

Record = dict[str, Any]


def plain_record(step: int, values: Mapping[str, Any]) -> Record:
    """A record ``{"step": step, **values}`` with tensor and numpy scalars turned into numbers."""
    record: Record = {"step": int(step)}
    for key, value in values.items():
        if not isinstance(key, str):
            raise FormatError(f"history keys must be strings, got {key!r}")
        record[key] = _plain(value, key)
    return record


def _plain(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    raise FormatError(
        f"history value {where!r} is a {type(value).__name__}: use numbers, strings, bools, "
        "None, lists and dicts"
    )


@dataclass(frozen=True)
class _Snapshot:
    digest: Digest | None
    manifest: Manifest | None

    @property
    def records(self) -> int:
        return int(self.manifest.meta.get("records", 0)) if self.manifest else 0


class TrainingHistory:
    """The append-only record log of one run, stored under ``ref``."""

    def __init__(self, repo: Repository, ref: str) -> None:
        self.repo = repo
        self.ref = ref
        self._written: _Snapshot | None = None
        """The version this object last committed: the next append builds on it without reading
        the ref and the manifest back. The compare-and-swap still catches any other writer."""

    def _current(self) -> _Snapshot:
        record = self.repo.refs_store.try_get(self.ref)
        if record is None:
            return _Snapshot(None, None)
        manifest = self.repo.manifest(record.target)
        if manifest.meta.get("format") != HISTORY_FORMAT:
            raise FormatError(f"ref {self.ref!r} is not a training history")
        if manifest.meta.get("version") != HISTORY_VERSION:
            raise FormatError(
                f"training history {self.ref!r} has unsupported version "
                f"{manifest.meta.get('version')!r}"
            )
        return _Snapshot(record.target, manifest)

    def __len__(self) -> int:
        return self._current().records

    def append(self, records: Sequence[Record]) -> int:
        """Append ``records`` (plain dicts) by compare-and-swap; return the new record count."""
        if not records:
            return len(self)
        snapshot = self._written or self._current()
        for _ in range(CAS_RETRIES):
            manifest = self._appended(snapshot, records)
            try:
                digest = self.repo.commit(
                    manifest, self.ref, expected=snapshot.digest, op="history"
                )
            except RefConflict:
                # Another writer appended first (or the ref moved): rebuild on its version.
                snapshot = self._current()
                continue
            self._written = _Snapshot(digest, manifest)
            return int(manifest.meta["records"])
        raise RefConflict(f"history {self.ref!r}: too many concurrent appends, gave up")

    def _appended(self, snapshot: _Snapshot, records: Sequence[Record]) -> Manifest:
        sealed: list[TensorEntry] = []
        tail: list[Record] = []
        if snapshot.manifest is not None:
            entries = list(snapshot.manifest.tensors)
            if entries and entries[-1].inline is not None:
                tail = _decode_segment(entries.pop().inline or b"")
            sealed = entries
        tail.extend(records)
        packed = _encode_segment(tail)
        if len(packed) > TAIL_MAX:
            new, _ = self.repo.write_tensors([_segment_source(packed)])
            sealed.append(new[0])
            segments = sealed
        else:
            inline = TensorEntry("torch", "uint8", (len(packed),), len(packed), (), packed)
            segments = [*sealed, inline]
        total = snapshot.records + len(records)
        tree = {
            "~": "dict",
            "items": [
                [
                    "segments",
                    {"~": "list", "items": [{"~": "tensor", "i": i} for i in range(len(segments))]},
                ]
            ],
        }
        return Manifest(
            kind="state",
            tensors=tuple(segments),
            tree=tree,
            meta={"format": HISTORY_FORMAT, "version": HISTORY_VERSION, "records": total},
            created_at=self.repo.clock(),
            parent=snapshot.digest,
            chunk_size=self.repo.config.chunk_size,
        )

    def read(self) -> list[Record]:
        """Every record, oldest first."""
        snapshot = self._current()
        if snapshot.manifest is None:
            return []
        manifest = snapshot.manifest
        values = self.repo.read_tensors(manifest, range(len(manifest.tensors)))
        out: list[Record] = []
        for index in range(len(manifest.tensors)):
            out.extend(_decode_segment(_tensor_bytes(values[index])))
        return out


def _segment_source(packed: bytes) -> TensorSource:
    return TensorSource("torch", "uint8", (len(packed),), memoryview(packed), "history")


def _encode_segment(records: Iterable[Record]) -> bytes:
    packed: bytes = msgpack.packb(list(records), use_bin_type=True)
    return packed


def _decode_segment(data: bytes) -> list[Record]:
    if len(data) > MAX_SEGMENT_BYTES:
        raise FormatError("history segment too large")
    try:
        records = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise FormatError(f"history segment is not valid msgpack: {e}") from e
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise FormatError("history segment is not a list of records")
    return records


def _tensor_bytes(value: Any) -> bytes:
    if isinstance(value, torch.Tensor):
        return bytes(value.contiguous().view(torch.uint8).numpy().tobytes())
    raise FormatError("history segment is not a byte tensor")
