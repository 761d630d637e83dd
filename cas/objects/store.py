"""Content-addressed objects: hash, encode and put chunks and manifests; get re-hashes and verifies.

Every stored object is an envelope (``cas.objects.envelope``) stored under the blake3 digest of
its *decoded* bytes, so the key never depends on the codec. Chunks live under
``chunks/<d[:2]>/<d>``, manifests under ``manifests/<d[:2]>/<d>``.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterable, Iterator, Sequence

from cas.blobstore.base import BlobStore, open_local_blob
from cas.blobstore.bulk import DEFAULT_WORKERS, read_into
from cas.blobstore.copier import BlobCopier
from cas.codecs import Codec, EncodeHints, codec_by_id, codec_by_name
from cas.digest import Digest, digest_of
from cas.errors import CASError, FormatError, IntegrityError, NotFound
from cas.objects import inventory, overlap, readcheck
from cas.objects.buffers import gather, scatter
from cas.objects.decoding import MAX_DELTA_DEPTH as MAX_DELTA_DEPTH
from cas.objects.decoding import ChainDecoder, OtherSize
from cas.objects.envelope import (
    HEADER,
    HEADER_SIZE,
    MAX_PARAMS,
    OBJECT_MAGIC,
    OBJECT_VERSION,
    RAW_CODEC_ID,
    encode_header,
    parse_envelope,
)
from cas.objects.keys import ObjectKind, StoredObject, object_key
from cas.objects.private import (
    PRIVATE_ALIGN_MIN,
    Encoding,
    ReuseOdds,
    copy_into,
    is_private,
    private_view,
)
from cas.objects.quarantine import Quarantine, QuarantineRecord
from cas.objects.results import CopiedObject as CopiedObject
from cas.objects.results import PutResult as PutResult
from cas.objects.staging import CPU_SLOTS, staging_pool
from cas.objects.sweep import Sweeper, sweeper_for

DEFAULT_HINTS = EncodeHints()
CREATE_ATTEMPTS = 3
"""Create-only puts of a chunk that keeps vanishing right after losing, before it is overwritten."""
HEAD_READ = 16 << 10
"""Bytes read from a chunk already stored to tell whether it may be reused: its header, and the
whole object when it is no larger, so a small one is verified in full for the one request."""


def chunk_key(digest: Digest) -> str:
    """The blob key of a chunk."""
    return object_key(ObjectKind.CHUNK, digest)


def manifest_key(digest: Digest) -> str:
    """The blob key of a manifest."""
    return object_key(ObjectKind.MANIFEST, digest)


class ObjectStore:
    """Chunks and manifests on a BlobStore: dedup on put, verification on get.

    ``put_chunk`` of a stored chunk writes nothing but refreshes its modification time, so an
    age-based GC sweep running concurrently spares it (dulwich's "freshen"). New chunks are
    written create-only: a chunk's first stored encoding is never replaced (``_create``).
    A read or verification that finds an object corrupt moves it into the store's quarantine
    (``cas.objects.quarantine``) when the fault lies in its own stored bytes, so it is no longer
    reused: ``_found_corrupt`` says how the fault is pinned on one object of a delta chain."""

    def __init__(self, blobs: BlobStore, *, max_object_size: int = 256 << 20) -> None:
        self.blobs = blobs
        self.max_object_size = max_object_size
        self.quarantine = Quarantine(blobs)
        self.chains = ChainDecoder(blobs, max_object_size)
        self._examining = threading.local()
        self._reuse = ReuseOdds()
        self._cold = blobs.for_background_writes()  # new chunks, past the page cache

    def has_chunk(self, digest: Digest) -> bool:
        """Whether the chunk is stored."""
        return self.blobs.has(chunk_key(digest))

    def put_chunk(
        self,
        data: bytes | bytearray | memoryview,
        codec: Codec,
        hints: EncodeHints = DEFAULT_HINTS,
        *,
        expected: Digest | None = None,
        freshen: bool = True,
        replace: bool = False,
        encoded: Encoding | None = None,
    ) -> PutResult:
        """Store one chunk unless present; return its digest, the bytes written and its base.

        This is the one door through which chunks are written, and it keeps invariant 9: the
        digest is computed here, from the very buffer that is then encoded and written. Bytes
        (or a view of bytes) cannot change and are used as they are; any other buffer (a tensor,
        an mmap, a bytearray) is first copied into a private one (a buffer leased from the staging
        pool, ``cas.objects.staging``, from 1 MiB on), so a caller whose memory or file changes
        meanwhile stores a consistent chunk, never one whose bytes are not its name.
        ``expected`` is the digest the caller believes the bytes have: IntegrityError if not.
        ``encoded`` is an ``Encoding`` made ahead (a codec trial), used only if it was made from
        this very ``data`` with this codec.

        Presence is learnt from the stored header, which also gives the base an existing chunk
        was delta-encoded against. A chunk found absent is written create-only: if another writer
        stored it meanwhile, its encoding stays and the result carries its base. An existing
        chunk whose header is unreadable (damaged, or an unknown codec) is written again, and so
        is a small one (``HEAD_READ``) that does not decode to ``data``;
        ``replace=True`` always writes, e.g. to re-encode a chunk standalone when its stored base
        chain is broken (safe against any writer: a standalone chunk needs no base). Decoded
        bytes, hence identity, never change.
        """
        miss = False
        if not replace and not is_private(data) and self._reuse.likely():
            # Probe where the bytes lie: a reuse writes nothing, so it needs no private reading
            # (invariant 9 is about what is written); a miss falls through to one.
            probed = digest_of(data)  # outside CPU_SLOTS: a re-save has no disk writes to feed
            if expected is None or probed == expected:
                reused = self._reused(probed, memoryview(data).nbytes, freshen)
                if reused is not None:
                    return reused
                miss = True
        view = memoryview(data).cast("B")
        if is_private(view) or view.nbytes < PRIVATE_ALIGN_MIN:
            return self._put_private(
                data, private_view(view), codec, hints, expected, freshen, replace, encoded, miss
            )
        # A large chunk of memory someone else may change: one copy into the staging pool, which
        # is private, warm, and laid out for a direct write past the page cache.
        with staging_pool().lease(view.nbytes) as staged:
            with CPU_SLOTS:
                copy_into(staged, view)
            return self._put_private(
                data, memoryview(staged), codec, hints, expected, freshen, replace, encoded, miss
            )

    def _put_private(
        self, data: object, view: memoryview, codec: Codec, hints: EncodeHints,
        expected: Digest | None, freshen: bool, replace: bool, encoded: Encoding | None,
        miss: bool = False,
    ) -> PutResult:  # fmt: skip
        """``put_chunk`` once ``view`` is a private reading of ``data``: hash, encode and write it
        create-only unless stored, past the page cache where the store can (a new raw chunk while
        it is hashed, ``cas.objects.overlap``, as is one a probe in place just found a ``miss``)."""
        plain = (
            expected is None and not replace and encoded is None and self._cold is not self.blobs
        )
        if plain and overlap.writes_first(view, codec, self._reuse, miss):
            stored, digest = overlap.write_while_hashing(self._cold, view, codec, self._reuse, miss)
            if stored:
                return PutResult(digest, len(view), HEADER_SIZE + len(view), True, None)
        else:
            with CPU_SLOTS:
                digest = digest_of(view)
        if expected is not None and digest != expected:
            raise IntegrityError(f"bytes given as chunk {expected} hash to {digest}; not stored")
        if not replace:
            reused = self._reused(digest, len(view), freshen)
            if reused is not None:
                return reused
        if encoded is not None and encoded.source is data and encoded.codec is codec:
            params, payload = encoded.params, encoded.payload
        else:
            with CPU_SLOTS:
                params, payload = codec.encode(view, hints)
        header = encode_header(codec, params, len(view))
        if replace:
            self.blobs.put(chunk_key(digest), (header, payload))
        else:
            outcome = self._create(digest, (header, payload), freshen, len(view), self._cold)
            if outcome is None:
                # Damaged, or gone again after every lost create: overwrite it, standalone, so
                # whichever of several repairing writers lands last, no manifest needs its base.
                if codec.needs_base:
                    codec = codec_by_name("zstd")
                    params, payload = codec.encode(view, hints)
                    header = encode_header(codec, params, len(view))
                self.blobs.put(chunk_key(digest), (header, payload))
            elif not outcome[0]:
                return PutResult(digest, len(view), 0, False, outcome[1])
        base = codec.base_of(params) if codec.needs_base else None
        return PutResult(digest, len(view), len(header) + len(payload), True, base)

    def _reused(self, digest: Digest, size: int, freshen: bool) -> PutResult | None:
        """The put of a chunk stored and sound (refreshed unless not ``freshen``), or None if it
        must be written; every answer updates the odds that the next put is a reuse."""
        present, base = self.stored_base(digest, size)
        if present and freshen:
            try:
                self.blobs.touch(chunk_key(digest))
            except FileNotFoundError:
                present = False  # swept between the header read and touch(): write it again
        self._reuse.observe(present)
        return PutResult(digest, size, 0, False, base) if present else None

    def _create(
        self, digest: Digest, parts: tuple[bytes, bytes | memoryview], freshen: bool, size: int,
        blobs: BlobStore,
    ) -> tuple[bool, Digest | None] | None:  # fmt: skip
        """Write a new chunk create-only: ``(True, None)`` if this call stored it, else
        ``(False, base)`` with the base of the encoding another writer stored first.

        Two writers can both find a chunk absent and encode it against different bases. Were the
        second write to replace the first, the first writer's manifest would record a base the
        stored chunk no longer needs, and GC, which reads manifests only, could sweep the one it
        does need. So the first write stays and the others record its base instead, refreshing
        it like any reused chunk. ``None`` says the caller must overwrite: the chunk is there but
        unreadable (damaged), or it vanished right after each lost create.
        """
        key = chunk_key(digest)
        for _ in range(CREATE_ATTEMPTS):
            if blobs.put_if_absent(key, parts):
                return True, None
            present, base = self.stored_base(digest, size)
            if present:
                try:
                    if freshen:
                        self.blobs.touch(key)
                except FileNotFoundError:
                    continue  # swept since: try to create it again
                return False, base
            if self.blobs.has(key):
                break  # damaged: no manifest can depend on how it is encoded
        return None  # the caller overwrites it

    def stored_base(self, digest: Digest, size: int | None = None) -> tuple[bool, Digest | None]:
        """``(present and sound, base)`` of a stored chunk (of ``size`` decoded bytes, if
        given), from one read of its first ``HEAD_READ`` bytes: whether a writer may reuse it. A
        header that is unreadable or declares another size is not sound, nor is a chunk read
        whole (small, and needing no base) whose bytes do not decode to ``digest``: writers
        store those again. Larger chunks are judged by their header alone; verifying them would
        cost a download per reuse (a reader that finds one corrupt quarantines it, and the next
        put stores it again).
        """
        try:
            head = self.blobs.get_range(chunk_key(digest), 0, HEAD_READ)
            envelope = parse_envelope(head, self.max_object_size)
            codec = codec_by_id(envelope.codec_id)
        except (NotFound, FormatError):
            return False, None
        if size is not None and envelope.decoded_size != size:
            return False, None
        if len(head) < HEAD_READ and not codec.needs_base:
            payload = memoryview(head)[envelope.payload_offset :]
            try:
                decoded = codec.decode(
                    envelope.params, payload, envelope.decoded_size, self.get_chunk
                )
            except FormatError:
                return False, None
            try:
                readcheck.verify_digest(decoded, digest, f"chunk {digest}")
            except IntegrityError:
                return False, None
        return True, codec.base_of(envelope.params)

    def get_chunk(self, digest: Digest) -> bytes | memoryview:
        """The verified decoded bytes of a chunk; IntegrityError if they do not hash to ``digest``.

        Delta bases on the way are decoded but not hashed one by one: a base with a wrong byte
        makes the chunk built on it hash wrong, so checking the chunk itself catches it, and a
        chain of depth d costs one hash instead of d + 1. A chunk found corrupt is quarantined
        (``_found_corrupt``); one found quarantined already is an IntegrityError too.
        """
        return self._get_chunk(digest, "read")

    def _get_chunk(
        self, digest: Digest, operation: str, out: memoryview | None = None
    ) -> bytes | memoryview:
        """``get_chunk``, or with ``out`` its bytes decoded straight into ``out`` (returned)."""
        key = chunk_key(digest)
        try:
            try:
                return self._verified(digest, self.blobs.get(key), out)
            except IntegrityError:
                # A cached copy that fails (damaged on the local disk, or stored against a base
                # the remote has since dropped) is read again from the store itself, chain
                # included.
                if not self.blobs.drop_cached(key):
                    raise
                self._drop_cached_chain(digest)
                return self._verified(digest, self.blobs.get(key), out)
        except NotFound as e:
            raise self._missing(ObjectKind.CHUNK, digest, e) from e
        except IntegrityError as e:
            raise self._found_corrupt(ObjectKind.CHUNK, digest, e, operation) from e

    def _missing(self, kind: ObjectKind, digest: Digest, error: NotFound) -> CASError:
        return self.quarantine.explain_missing(kind, digest, error)

    def _found_corrupt(
        self, kind: ObjectKind, digest: Digest, error: IntegrityError, operation: str
    ) -> IntegrityError:
        return self.quarantine.found_corrupt(
            kind, digest, error, operation, lambda blob: self._fault_in(kind, digest, blob)
        )

    def _fault_in(self, kind: ObjectKind, digest: Digest, blob: bytes) -> str | None:
        """What is wrong with ``blob``, the stored bytes of an object found corrupt; None when
        they are sound (a writer stored a good copy meanwhile) or the fault is not theirs.

        A delta chunk is rebuilt from its base, whose bytes are checked only through the chunk
        built on it, so a bad base makes a good delta hash wrong. The base is therefore read
        first and verified on its own (which quarantines it if its own bytes are bad); only when
        it is good are the delta's bytes to blame. A delta whose base is missing, corrupt or
        leads back to it stays where it is: the next save of it finds its chain broken and
        stores it standalone, and ``verify --repair-from`` rewrites it.
        """
        examining: set[Digest] = self._examining.__dict__.setdefault("digests", set())
        if digest in examining:
            return None  # a chain that leads back to itself: no one object to blame
        examining.add(digest)
        try:
            envelope = parse_envelope(blob, self.max_object_size)
            codec = codec_by_id(envelope.codec_id)
            base = codec.base_of(envelope.params) if kind is ObjectKind.CHUNK else None
            if base is not None:
                self.get_chunk(base)
            payload = memoryview(blob)[envelope.payload_offset :]
            decoded = codec.decode(envelope.params, payload, envelope.decoded_size, self.get_chunk)
        except FormatError as e:
            return str(e)
        except CASError:
            return None  # the base, not these bytes
        finally:
            examining.discard(digest)
        try:
            readcheck.verify_digest(
                decoded, digest, f"{kind.noun} {digest}", size=envelope.decoded_size
            )
        except IntegrityError:
            return "its bytes hash to something else"
        return None

    def _drop_cached_chain(self, digest: Digest) -> None:
        """Drop cached copies of the bases the stored ``digest`` depends on (headers only)."""
        current: Digest | None = digest
        for _ in range(MAX_DELTA_DEPTH):
            try:
                current = self.chunk_base(current) if current is not None else None
            except (NotFound, IntegrityError):
                return
            if current is None:
                return
            self.blobs.drop_cached(chunk_key(current))

    def _verified(
        self, digest: Digest, blob: bytes | bytearray, out: memoryview | None = None
    ) -> bytes | memoryview:
        """The decoded ``blob``, in ``out`` when given, checked against ``digest``."""
        if out is None:
            decoded = self.chains.decode(digest, blob)
        else:
            self.chains.decode_into(digest, blob, out)
            decoded = out
        readcheck.verify_digest(decoded, digest, f"chunk {digest} (or a delta base of it)")
        return decoded

    def read_chunk_into(self, digest: Digest, out: memoryview, *, encoded: bool = False) -> None:
        """Fill ``out`` (exactly the chunk's size) with the verified chunk bytes."""
        self.read_chunk_parts(digest, [out], encoded=encoded)

    def read_chunk_parts(
        self, digest: Digest, outs: Sequence[memoryview], *, encoded: bool = False
    ) -> None:
        """Scatter the verified chunk bytes over ``outs`` in order (their sizes sum to the chunk's).

        On stores that read in place (local files) a raw chunk goes straight from its file into
        the buffers in one read and is hashed there, with no intermediate copy: a reader whose
        range ends inside a chunk gets that head in its own buffer and the rest in a side buffer.
        An encoded chunk read into one buffer is decompressed straight into it, its delta base
        too, and hashed there. ``encoded`` says the chunk is likely stored encoded (its tensor
        was written with a codec): it is then read whole at once rather than in place first.
        """
        whole = len(outs) == 1
        if self.blobs.reads_in_place and not (encoded and whole):
            try:
                if self._read_in_place(digest, outs):
                    return
            except NotFound as e:
                raise self._missing(ObjectKind.CHUNK, digest, e) from e
            except IntegrityError as e:
                raise self._found_corrupt(ObjectKind.CHUNK, digest, e, "read") from e
        if whole:
            try:
                self._get_chunk(digest, "read", outs[0])
                return
            except OtherSize:
                pass  # the manifest's size is wrong, not the chunk: said below, not quarantined
        scatter(memoryview(self.get_chunk(digest)).cast("B"), outs, digest)

    def _read_in_place(self, digest: Digest, outs: Sequence[memoryview]) -> bool:
        """``read_chunk_parts`` from a local file; False when the chunk must be decoded."""
        size = sum(len(out) for out in outs)
        header = memoryview(bytearray(HEADER_SIZE))
        lease = staging_pool().lease_pages  # a cold file comes past the page cache through it
        got = read_into(self.blobs, chunk_key(digest), 0, [header, *outs], lease)
        if got < HEADER_SIZE:
            raise IntegrityError(f"chunk {digest} is corrupt: shorter than its header")
        # Only the fixed fields are here; other codecs' parameters follow and are checked by
        # get_chunk.
        magic, version, codec_id, params_len, decoded_size = HEADER.unpack_from(header, 0)
        fixed = (OBJECT_MAGIC, OBJECT_VERSION, RAW_CODEC_ID, 0)
        if (magic, version, codec_id, params_len) == fixed and decoded_size == size:
            if got != HEADER_SIZE + size:
                raise IntegrityError(f"chunk {digest} is corrupt: its bytes hash to something else")
            readcheck.verify_digest(outs, digest, f"chunk {digest}")
            return True
        if got < HEADER_SIZE + size:
            # An encoded chunk smaller than its decoded bytes was read whole: decode that copy
            # rather than reading the file again.
            blob = gather([header, *outs], got)
            if len(outs) == 1 and decoded_size == size:
                self._verified(digest, blob, outs[0])  # its bytes are copied aside: decode in
                return True
            decoded = memoryview(self._verified(digest, blob)).cast("B")
            scatter(decoded, outs, digest)
            return True
        return False

    def chunk_base(self, digest: Digest) -> Digest | None:
        """The base chunk a delta-encoded chunk depends on, read from its header only."""
        head = self.blobs.get_range(chunk_key(digest), 0, HEADER_SIZE + MAX_PARAMS)
        try:
            envelope = parse_envelope(head, self.max_object_size)
            return codec_by_id(envelope.codec_id).base_of(envelope.params)
        except FormatError as e:
            raise IntegrityError(f"chunk {digest} is corrupt: {e}") from e

    def put_manifest(self, data: bytes, codec: Codec) -> Digest:
        """Store an encoded manifest; return its digest."""
        digest = digest_of(data)
        key = manifest_key(digest)
        if not self.blobs.has(key):
            params, payload = codec.encode(memoryview(data), EncodeHints(level=3))
            self.blobs.put(key, (encode_header(codec, params, len(data)), payload))
        else:
            self.blobs.touch(key)
        return digest

    def get_manifest(self, digest: Digest) -> bytes:
        """The verified bytes of a manifest; a corrupt one is quarantined (IntegrityError)."""
        try:
            blob = self.blobs.get(manifest_key(digest))
        except NotFound as e:
            missing = NotFound(f"manifest {digest} is missing from the store")
            raise self._missing(ObjectKind.MANIFEST, digest, missing) from e
        try:
            decoded = bytes(self.chains.decode(digest, blob, "manifest"))
            readcheck.verify_digest(decoded, digest, f"manifest {digest}")
        except IntegrityError as e:
            raise self._found_corrupt(ObjectKind.MANIFEST, digest, e, "read") from e
        return decoded

    def map_raw_chunk(self, digest: Digest, size: int) -> memoryview | None:
        """A raw chunk's bytes mapped copy-on-write from its local file, verified; None where
        the store has no local files or the chunk is not stored raw (read it instead).

        NotFound if the chunk is missing; IntegrityError if its bytes do not hash to ``digest``.
        """
        path = self.blobs.local_path(chunk_key(digest))
        if path is None:
            return None
        try:
            with open(open_local_blob(path, chunk_key(digest)), "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except NotFound as e:
            missing = NotFound(f"chunk {digest} is missing from the store")
            raise self._missing(ObjectKind.CHUNK, digest, missing) from e
        if len(mapped) != HEADER_SIZE + size or mapped[5] != RAW_CODEC_ID:
            mapped.close()
            return None  # not a raw chunk
        payload = memoryview(mapped)[HEADER_SIZE:]
        try:
            readcheck.verify_digest(payload, digest, f"chunk {digest}")
        except IntegrityError as error:
            raise self._found_corrupt(ObjectKind.CHUNK, digest, error, "read") from error
        return payload

    # -- the store as a whole: what retention and transfers ask of it ---------------------------

    @property
    def url(self) -> str:
        """Where the objects live."""
        return self.blobs.url

    def sync(self) -> None:
        """Make every object stored so far durable (before a manifest or ref names them)."""
        if self._cold is not self.blobs:
            self._cold.sync()
        self.blobs.sync()

    def list_objects(self, kind: ObjectKind) -> Iterator[StoredObject]:
        """Every stored object of ``kind`` with its stored size and mtime (one listing)."""
        return inventory.list_objects(self.blobs, kind)

    def stat(self, kind: ObjectKind, digest: Digest) -> StoredObject:
        """Stored size and mtime of one object; NotFound if it is not stored."""
        return inventory.stat_object(self.blobs, kind, digest)

    def stored_sizes(
        self, objects: Iterable[tuple[ObjectKind, Digest]]
    ) -> dict[tuple[ObjectKind, Digest], int]:
        """Stored bytes of each object (missing ones left out), by ``stat`` or one listing."""
        return inventory.stored_sizes(self.blobs, objects)

    def has_many(
        self, kind: ObjectKind, digests: Iterable[Digest], workers: int = DEFAULT_WORKERS
    ) -> dict[Digest, bool]:
        """Whether each object is stored, asked ``workers`` at a time."""
        return inventory.present(self.blobs, kind, digests, workers)

    def missing(self, kind: ObjectKind, digests: Sequence[Digest]) -> tuple[set[Digest], str]:
        """Which objects are not stored, by existence requests or by listing, whichever costs
        fewer requests; and which was used (``has`` or ``list``)."""
        return inventory.missing(self.blobs, kind, digests)

    def freshen(
        self, kind: ObjectKind, digests: Iterable[Digest], workers: int = DEFAULT_WORKERS
    ) -> list[Digest]:
        """Refresh each object's mtime so an age-based GC spares it; return those not stored."""
        return inventory.freshen(self.blobs, kind, digests, workers)

    def sweeper(self) -> Sweeper:
        """The safest way this store allows to delete GC's candidates (``cas.objects.sweep``)."""
        return sweeper_for(self.blobs)

    def verify(self, digest: Digest) -> int:
        """Re-read and re-hash a chunk; its decoded size. IntegrityError (quarantined, when its
        own bytes are at fault) or NotFound if bad."""
        return len(self._get_chunk(digest, "verify"))

    def declared(self, digest: Digest) -> tuple[int, Digest | None]:
        """The decoded size and the delta base a stored chunk's header declares (one small
        ranged read, no decoding); NotFound if missing, IntegrityError (quarantined) if bad."""
        try:
            head = self.blobs.get_range(chunk_key(digest), 0, HEADER_SIZE + MAX_PARAMS)
            envelope = parse_envelope(head, self.max_object_size)
            return envelope.decoded_size, codec_by_id(envelope.codec_id).base_of(envelope.params)
        except NotFound as e:
            raise self._missing(ObjectKind.CHUNK, digest, e) from e
        except FormatError as e:
            error = IntegrityError(f"chunk {digest} is corrupt: {e}")
            raise self._found_corrupt(ObjectKind.CHUNK, digest, error, "verify") from e

    def quarantined(self) -> list[QuarantineRecord]:
        """Every object this store has moved aside as corrupt (``cas.objects.quarantine``)."""
        return list(self.quarantine.records())

    def verify_stored(
        self, kind: ObjectKind, digest: Digest, blob: bytes | bytearray
    ) -> bytes | memoryview:
        """The decoded bytes of a stored object ``blob`` (delta bases read from this store),
        checked against ``digest``; IntegrityError naming this store if they do not match."""
        where = f"{kind.noun} {digest} in {self.url}"
        try:
            envelope = parse_envelope(blob, self.max_object_size)
            decoded = codec_by_id(envelope.codec_id).decode(
                envelope.params,
                memoryview(blob)[envelope.payload_offset :],
                envelope.decoded_size,
                self.get_chunk,
            )
        except FormatError as e:
            raise IntegrityError(f"{where} is corrupt: {e}") from e
        readcheck.verify_digest(decoded, digest, where, size=envelope.decoded_size)
        return decoded

    def copy(self, kind: ObjectKind, digest: Digest, to: ObjectStore) -> CopiedObject:
        """Copy one object into ``to`` as it is stored here (its codec kept; its sealed form,
        between stores of one key: ``BlobCopier``), verified first, so corrupt bytes never travel.
        Create-only: an object ``to`` holds already (perhaps a delta against another base, which
        a manifest there records) keeps its encoding and is refreshed instead, so an age-based
        GC there spares it. NotFound if it is not stored here."""
        copier = BlobCopier(self.blobs, to.blobs)
        try:
            blob = copier.get(object_key(kind, digest))
        except NotFound as e:
            raise NotFound(f"{kind.noun} {digest} is missing from {self.url}") from e
        try:
            decoded = self.verify_stored(kind, digest, blob)
        except IntegrityError as e:
            raise self._found_corrupt(kind, digest, e, "copy") from e
        envelope = parse_envelope(blob, self.max_object_size)
        base = codec_by_id(envelope.codec_id).base_of(envelope.params)
        created = copier.put_if_absent(object_key(kind, digest), blob)
        if not created:
            with contextlib.suppress(NotFound):
                to.blobs.touch(object_key(kind, digest))
        return CopiedObject(kind, digest, created, len(decoded), len(blob), base)
