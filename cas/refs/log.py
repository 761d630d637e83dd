"""Append logs: an append-only list of plain msgpack records under one ref, in immutable segments.

A log is a ref naming its *head*, a ``kind="files"`` manifest (docs/format.md, "Append logs"):

    meta   {"format": "cas-log", "version": 1, "kind": <what the log holds>, "records": total,
            "segments": [records in segment 0, 1, ...], "tail": [newest records, oldest first]}
    files  {"segments/00000000.msgpack": one chunk, ...}    the sealed segments, oldest first

A segment is one chunk holding ``{"format": "cas-log-segment", "version": 1, "kind", "records"}``.
Appending builds the next head from the current one and moves the ref through
``RefStore.update``, so concurrent writers never lose each other's records: the loser reads the
winner's head and appends onto it. The tail is rewritten by every append; once it outgrows
``TAIL_BYTES`` it is sealed into segments that every later head shares, so an append costs
O(new records), not O(log). GC needs nothing special: segments are chunks the head names.

Reads are verified: chunks and manifests by their digests, and every segment against the count
and kind its head lists. Heads in the layouts older than this one are read by
``cas.refs.legacy_logs`` and rewritten in this layout by the next append.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from cas.codecs import codec_by_name
from cas.digest import Digest
from cas.errors import CASError, FormatError
from cas.model.bounded import unpack_bounded
from cas.model.manifest import ChunkRef, FileEntry, Manifest, decode_manifest, encode_manifest
from cas.names import RefName, parse_ref_name
from cas.refs import legacy_logs, segments
from cas.refs.records import RefRecord
from cas.refs.store import RefChange, RefStore

LOG_FORMAT = "cas-log"
LOG_VERSION = 1
SEGMENT_FORMAT = "cas-log-segment"
SEGMENT_VERSION = 1
SEGMENT_DIR = "segments/"
TAIL_BYTES = 64 << 10
"""A tail whose msgpack is larger than this is sealed into segments at the next append."""
SEGMENT_BYTES = 4 << 20
"""Sealing cuts the tail into segments of about this size (a larger record gets one alone)."""
MAX_RECORD_BYTES = 16 << 20
MAX_SEGMENT_BYTES = 64 << 20
MAX_RECORD_NESTING = 64
"""msgpack levels a segment may nest: its map, its record list, and the records themselves."""
"""Reading refuses a segment whose bytes exceed this, whatever its head claims."""
ABSORBED_KEY = "jsonl_absorbed"
"""Head meta: the log holds the records an older layout kept as JSON-lines blobs."""
LOOKBACK = 4096
"""How many of the newest records ``append(unique=...)`` compares against by default."""

LogRecord = Any
"""A plain msgpack value: None, bool, int, float, str, bytes, lists and maps of these."""


@dataclass(frozen=True)
class LogSegment:
    """One sealed segment as its head lists it."""

    path: str
    chunk: ChunkRef
    count: int


@dataclass(frozen=True)
class LogHead:
    """A version of a log: its newest records inline and its sealed segments, oldest first.

    ``digest`` is the head manifest (None for a log that does not exist yet). A head in an older
    layout (``legacy``) holds all its records as the tail; the next append seals them anew.
    """

    digest: Digest | None
    tail: tuple[LogRecord, ...] = ()
    segments: tuple[LogSegment, ...] = ()
    legacy: bool = False
    absorbed: bool = False
    """The log holds the records once kept as JSON lines (``absorb_jsonl``): they are not read
    from there again."""

    @property
    def count(self) -> int:
        """How many records this version holds."""
        return segments.total(self.tail, self.segments)


@dataclass(frozen=True)
class Appended:
    """What an append did: records added (after dropping known ones) and the log's new length."""

    added: int
    total: int


class AppendLog:
    """The append log of ``kind`` under the ref ``name``.

    ``kind`` names what the records are (``"training-history"``, ``"eviction-log"``...); a ref
    holding another kind of log, or no log at all, is a FormatError rather than a guess.
    ``legacy_jsonl``: an eviction log name whose records kept in the JSON-lines layout are read
    before this log's own. Appends hold a writer lease of the ref store's writers, so GC spares
    the segment and head they write before the ref names them.
    """

    def __init__(
        self, refs: RefStore, name: str, kind: str, *, legacy_jsonl: str | None = None
    ) -> None:
        self.refs = refs
        self.objects = refs.objects
        self.name: RefName = parse_ref_name(name)
        self.kind = kind
        self.legacy_jsonl = legacy_jsonl
        self._head: LogHead = LogHead(None)
        """The head last read or written, reused while the ref still names it."""
        self._segment: tuple[Digest, tuple[LogRecord, ...]] | None = None
        """The segment last read: appends that check for known records re-read the newest."""

    # -- reading -------------------------------------------------------------------------------

    def head(self) -> LogHead:
        """The log's current version (an empty head when the ref does not exist)."""
        return self._head_of(self.refs.try_get(self.name))

    def __len__(self) -> int:
        head = self.head()
        return head.count + len(self._before(head))

    def records(self) -> list[LogRecord]:
        """Every record, oldest first."""
        return list(self.oldest_first())

    def oldest_first(self, head: LogHead | None = None) -> Iterator[LogRecord]:
        """Every record, oldest first; segments are read as the walk gets there."""
        head = head or self.head()
        yield from self._before(head)
        yield from segments.oldest_first(head.tail, head.segments, self._read_segment)

    def newest_first(self, head: LogHead | None = None) -> Iterator[LogRecord]:
        """Every record, newest first; older segments are read only if the walk gets there."""
        head = head or self.head()
        yield from segments.newest_first(head.tail, head.segments, self._read_segment)
        yield from reversed(self._before(head))

    def _before(self, head: LogHead) -> list[LogRecord]:
        if self.legacy_jsonl is None or head.absorbed or not self.refs.legacy_layouts:
            return []
        return list(legacy_logs.jsonl_records(self.refs.blobs, self.legacy_jsonl))

    def _head_of(self, record: RefRecord | None) -> LogHead:
        if record is None:
            return LogHead(None)
        if self._head.digest == record.target:
            return self._head
        where = f"log {self.name!r}: head {record.target}"
        try:
            manifest = decode_manifest(self.objects.get_manifest(record.target))
        except CASError as e:
            raise type(e)(f"{where}: {e}") from e
        head = self._parse_head(record.target, manifest, where)
        self._head = head
        return head

    def _parse_head(self, digest: Digest, manifest: Manifest, where: str) -> LogHead:
        meta = manifest.meta
        if meta.get("format") != LOG_FORMAT:
            old = legacy_logs.legacy_records(manifest, self.kind, self.objects)
            if old is None:
                raise FormatError(f"ref {self.name!r} is not a {self.kind} log")
            return LogHead(digest, tuple(old), (), legacy=True)
        if meta.get("version") != LOG_VERSION:
            raise FormatError(f"{where} has unsupported version {meta.get('version')!r}")
        if meta.get("kind") != self.kind:
            raise FormatError(
                f"ref {self.name!r} holds a {meta.get('kind')!r} log, not {self.kind}"
            )
        tail, counts = meta.get("tail"), meta.get("segments")
        if not isinstance(tail, list) or not isinstance(counts, list):
            raise FormatError(f"{where} is corrupt: tail or segment counts missing")
        if len(counts) != len(manifest.files) or manifest.tensors:
            raise FormatError(f"{where} lists {len(counts)} segments but names other objects")
        sealed = []
        for index, count in enumerate(counts):
            path = _segment_path(index)
            entry = manifest.files.get(path)
            if entry is None or entry.format != SEGMENT_FORMAT or len(entry.chunks) != 1:
                raise FormatError(f"{where} is corrupt: no segment file {path}")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise FormatError(f"{where} is corrupt: bad count {count!r} for {path}")
            sealed.append(LogSegment(path, entry.chunks[0], count))
        absorbed = meta.get(ABSORBED_KEY) is True
        head = LogHead(digest, tuple(tail), tuple(sealed), absorbed=absorbed)
        if meta.get("records") != head.count:
            raise FormatError(f"{where} holds {head.count} records, it says {meta.get('records')}")
        return head

    def _read_segment(self, segment: LogSegment) -> tuple[LogRecord, ...]:
        """A segment's records, oldest first, verified against its digest, kind and count."""
        digest = segment.chunk.digest
        if self._segment is not None and self._segment[0] == digest:
            return self._segment[1]
        where = f"log {self.name!r}: segment {segment.path} ({digest})"
        if segment.chunk.size > MAX_SEGMENT_BYTES:
            raise FormatError(f"{where} is larger than {MAX_SEGMENT_BYTES} bytes")
        try:
            data = self.objects.get_chunk(digest)
        except CASError as e:
            raise type(e)(f"{where}: {e}") from e
        doc = unpack_bounded(bytes(data), where, max_depth=MAX_RECORD_NESTING)
        if not isinstance(doc, dict) or doc.get("format") != SEGMENT_FORMAT:
            raise FormatError(f"{where} is not an append-log segment")
        if doc.get("version") != SEGMENT_VERSION:
            raise FormatError(f"{where} has unsupported version {doc.get('version')!r}")
        if doc.get("kind") != self.kind or not isinstance(doc.get("records"), list):
            raise FormatError(f"{where} is not a segment of a {self.kind} log")
        records = tuple(segments.check_count(doc["records"], segment, where))
        self._segment = (digest, records)
        return records

    # -- appending -----------------------------------------------------------------------------

    def append(
        self,
        records: Iterable[LogRecord],
        *,
        op: str = "append",
        message: str = "",
        unique: Callable[[LogRecord], Hashable] | None = None,
        lookback: int | None = LOOKBACK,
    ) -> Appended:
        """Append ``records`` (oldest first) by compare-and-swap of the log's ref.

        ``unique``: a key per record; a record whose key is already among the newest
        ``lookback`` records of the log (None: all of them), or earlier in this batch, is
        dropped, so an append that is repeated after a crash adds nothing twice.
        """
        new = [_checked(record) for record in records]
        if not new:
            return Appended(0, len(self))
        outcome = Appended(0, 0)

        def extended(current: RefRecord | None) -> Digest | RefChange:
            nonlocal outcome
            head = self._head_of(current)
            pending = new if unique is None else self._unseen(head, new, unique, lookback)
            if not pending:
                outcome = Appended(0, head.count)
                return RefChange.KEEP
            digest = self._store_head(head, pending)
            outcome = Appended(len(pending), head.count + len(pending))
            return digest

        leases = self.refs.leases
        with leases.hold(f"append to {self.name}") if leases else contextlib.nullcontext():
            self.refs.update(self.name, extended, op=op, message=message)
        return Appended(outcome.added, outcome.total + len(self._before(self._head)))

    # -- moving older layouts forward ------------------------------------------------------------

    def rewrite(self, *, op: str = "migrate") -> bool:
        """Store a head kept in an older layout again in this one, every record as it was;
        False when the log is already in this layout (or absent)."""
        changed = False

        def rewritten(current: RefRecord | None) -> Digest | RefChange:
            nonlocal changed
            head = self._head_of(current)
            changed = head.legacy
            if not head.legacy:
                return RefChange.KEEP
            return self._store_head(LogHead(head.digest), list(head.tail))

        self._under_lease(rewritten, op)
        return changed

    def absorb_jsonl(self, *, op: str = "migrate") -> int:
        """Copy the records kept as JSON lines (``legacy_jsonl``) into the log, in front of its
        own, then delete the JSON-lines blobs; return how many blobs went.

        The head that holds the copies says so, and readers stop reading the blobs from then on,
        so a crash before the blobs are deleted duplicates nothing and a rerun deletes them.
        """
        if self.legacy_jsonl is None:
            return 0

        def absorbed(current: RefRecord | None) -> Digest | RefChange:
            head = self._head_of(current)
            if head.absorbed:
                return RefChange.KEEP
            records = list(self.oldest_first(head))  # the JSON lines first, then its own
            return self._store_head(LogHead(head.digest), records, absorb=True)

        self._under_lease(absorbed, op)
        return legacy_logs.delete_jsonl(self.refs.blobs, self.legacy_jsonl)

    def _under_lease(self, fn: Callable[[RefRecord | None], Digest | RefChange], op: str) -> None:
        leases = self.refs.leases
        with leases.hold(f"{op} {self.name}") if leases else contextlib.nullcontext():
            self.refs.update(self.name, fn, op=op)

    def _unseen(
        self,
        head: LogHead,
        new: list[LogRecord],
        unique: Callable[[LogRecord], Hashable],
        lookback: int | None,
    ) -> list[LogRecord]:
        recent = itertools.islice(self.newest_first(head), lookback)
        known = {unique(record) for record in recent}
        pending = []
        for record in new:
            key = unique(record)
            if key not in known:
                known.add(key)
                pending.append(record)
        return pending

    def _store_head(self, head: LogHead, new: list[LogRecord], *, absorb: bool = False) -> Digest:
        """Store the head that follows ``head`` with ``new`` appended (sealing a tail that grew
        too large first); return its digest. The ref is not moved here."""
        tail = [*head.tail, *new]
        sealed = list(head.segments)
        if len(_pack(tail)) > TAIL_BYTES:
            for batch in _batches(tail):
                sealed.append(self._seal(batch, len(sealed)))
            tail = []
        manifest = Manifest(
            kind="files",
            tensors=(),
            files={
                s.path: FileEntry(s.chunk.size, SEGMENT_FORMAT, (s.chunk,), (), 0o644)
                for s in sealed
            },
            meta={
                "format": LOG_FORMAT,
                "version": LOG_VERSION,
                "kind": self.kind,
                "records": len(tail) + sum(s.count for s in sealed),
                "segments": [s.count for s in sealed],
                "tail": tail,
                **({ABSORBED_KEY: True} if absorb or head.absorbed else {}),
            },
            created_at=self.refs.clock(),
            parent=head.digest,
        )
        digest = self.objects.put_manifest(encode_manifest(manifest), codec_by_name("zstd"))
        self.refs.blobs.sync()  # segments and head are durable before a ref names them
        self._head = LogHead(digest, tuple(tail), tuple(sealed), absorbed=absorb or head.absorbed)
        return digest

    def _seal(self, records: Sequence[LogRecord], index: int) -> LogSegment:
        payload = _pack(
            {
                "format": SEGMENT_FORMAT,
                "version": SEGMENT_VERSION,
                "kind": self.kind,
                "records": list(records),
            }
        )
        stored = self.objects.put_chunk(payload, codec_by_name("zstd"))
        return LogSegment(_segment_path(index), ChunkRef(stored.digest, len(payload)), len(records))


def _segment_path(index: int) -> str:
    return f"{SEGMENT_DIR}{index:08d}.msgpack"


def _pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _checked(record: LogRecord) -> LogRecord:
    """``record`` if it is a plain msgpack value of bounded size, else a FormatError."""
    try:
        size = len(_pack(record))
    except (TypeError, ValueError, OverflowError) as e:
        raise FormatError(f"a log record must be a plain msgpack value: {e}") from e
    if size > MAX_RECORD_BYTES:
        raise FormatError(f"a log record of {size} bytes is larger than {MAX_RECORD_BYTES}")
    return record


def _batches(records: Sequence[LogRecord]) -> Iterator[Sequence[LogRecord]]:
    """``records`` cut, in order, into runs of about ``SEGMENT_BYTES`` of msgpack."""
    start, size = 0, 0
    for index, record in enumerate(records):
        record_size = len(_pack(record))
        if index > start and size + record_size > SEGMENT_BYTES:
            yield records[start:index]
            start, size = index, 0
        size += record_size
    if start < len(records):
        yield records[start:]


def legacy_jsonl_names(refs: RefStore) -> set[str]:
    """Names of the eviction logs still kept (also) in the JSON-lines layout."""
    return legacy_logs.jsonl_names(refs.blobs) if refs.legacy_layouts else set()
