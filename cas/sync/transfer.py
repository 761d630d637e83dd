"""Push/pull between stores: copy only the chunks and manifests the other side lacks, then CAS refs.

``transfer(src, dst, selectors)`` (``push`` and ``pull`` name the direction) works in the order a
save does, so a destination ref never names a manifest whose chunks are missing (invariant 1):

1. Read the selected refs on both sides (prefixes, exact names, globs like ``runs/r1/**``). The
   destination targets read here are the ``expected`` values of the final compare-and-swap.
2. Read and verify each selected manifest on the source and collect its chunk digests
   (``Manifest.chunk_digests()``, delta bases included). GC keeps chunks alive from manifests
   alone (invariant 4), so a copied chunk that is a delta against a base its manifests do not
   list is refused (``UnlistedBase``): GC would sweep that base and the checkpoint with it. The
   refusal comes before any manifest or ref is written; chunks copied so far are unreferenced.
3. Ask the destination which chunks it already has (``ObjectStore.missing``: one existence
   request per chunk for small sets, a listing of the touched ``chunks/<xx>/`` prefixes when
   that costs fewer requests).
4. Copy the missing chunks in parallel as stored (``ObjectStore.copy``: the codec is kept); each
   is decoded and hashed on the way, so corrupt bytes never travel. With ``codec=`` set, chunks
   are re-encoded for the destination instead (``cas.objects.recode``), e.g. zstd for an
   archive. Copies are create-only: a chunk a destination writer stores meanwhile keeps that
   writer's encoding.
5. ``sync`` the destination, copy the manifests, ``sync`` again, then move each destination ref by
   compare-and-swap. A ref that moved meanwhile is a ``RefConflict``; everything copied stays, and
   the old target remains in the ref's history, so nothing is lost.

An interrupted transfer leaves only unreferenced chunks behind; run again, it finds them present
and copies the rest. Chunks and manifests the destination already holds are refreshed, so an
age-based GC running there does not sweep them before the ref lands. Both sides are ``Stores``
(``cas.refs.stores``); ``Repository.push`` and ``pull`` are the front door.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from cas.codecs import codec_by_name
from cas.digest import Digest
from cas.errors import BackendError, CASError, IntegrityError, NotFound, RefConflict
from cas.model.manifest import ITEMSIZE, Manifest, decode_manifest
from cas.names import RefName
from cas.objects.keys import ObjectKind
from cas.objects.recode import KEEP
from cas.refs.store import RefStore
from cas.refs.stores import Stores

TransferProgress = Callable[[int, int], None]
"""Called with ``(bytes_moved, bytes_skipped)`` increments, in logical (decoded) bytes."""

__all__ = [
    "KEEP",
    "TransferConflict",
    "TransferReport",
    "UnlistedBase",
    "pull",
    "push",
    "transfer",
]


@dataclass(frozen=True)
class RefUpdate:
    """What happened to one destination ref."""

    name: RefName
    old: Digest | None
    new: Digest
    status: str
    """``created``, ``updated``, ``unchanged`` (already there) or ``conflict`` (moved meanwhile)."""


@dataclass
class TransferReport:
    """What a transfer moved and skipped. Byte counts are logical (decoded) chunk bytes."""

    source: str
    destination: str
    refs: list[RefUpdate] = field(default_factory=list)
    chunks_moved: int = 0
    chunks_skipped: int = 0
    bytes_moved: int = 0
    bytes_skipped: int = 0
    manifests_moved: int = 0
    manifests_skipped: int = 0
    chunks_rewritten: int = 0
    """Chunks the destination held encoded against a base the copied manifests do not record,
    rewritten standalone so GC (which reads manifests only) can never sweep what they need; and
    small chunks it held damaged, replaced by the source's verified bytes."""
    wire_bytes: int = 0
    """Stored (encoded) bytes written to the destination, manifests included."""
    lookup: str = "has"
    """How missing chunks were found: ``has`` (one request per key) or ``list`` (by prefix)."""
    seconds: float = 0.0
    chunks: frozenset[Digest] = frozenset()
    """Every chunk the copied manifests name, on the destination once the transfer returns: the
    next drain's ``known``. Not in ``as_dict``: a push of many checkpoints names many."""

    @property
    def refs_updated(self) -> int:
        """Refs created or moved."""
        return sum(1 for r in self.refs if r.status in ("created", "updated"))

    def as_dict(self) -> dict[str, object]:
        """Plain values for ``--json``."""
        return {
            "source": self.source,
            "destination": self.destination,
            "refs": [
                {"ref": r.name, "old": r.old, "new": r.new, "status": r.status} for r in self.refs
            ],
            "refs_updated": self.refs_updated,
            "chunks_moved": self.chunks_moved,
            "chunks_skipped": self.chunks_skipped,
            "bytes_moved": self.bytes_moved,
            "bytes_skipped": self.bytes_skipped,
            "manifests_moved": self.manifests_moved,
            "manifests_skipped": self.manifests_skipped,
            "chunks_rewritten": self.chunks_rewritten,
            "wire_bytes": self.wire_bytes,
            "lookup": self.lookup,
            "seconds": round(self.seconds, 3),
        }


class TransferConflict(RefConflict):
    """Some destination refs moved during the transfer; ``report`` says which, data is all there."""

    def __init__(self, message: str, report: TransferReport) -> None:
        super().__init__(message)
        self.report = report


class UnlistedBase(IntegrityError):
    """A chunk to copy is a delta against a base its manifest does not list, so GC, which reads
    manifests only, would delete that base and break the checkpoint; nothing was published."""


@dataclass(frozen=True)
class _Selected:
    name: RefName
    target: Digest
    remote_old: Digest | None


def push(
    src: Stores,
    dst: Stores,
    selectors: Sequence[str],
    *,
    jobs: int = 16,
    progress: TransferProgress | None = None,
    codec: str = KEEP,
) -> TransferReport:
    """Copy the refs ``selectors`` pick from ``src`` to ``dst`` (see the module docstring)."""
    return transfer(src, dst, selectors, jobs=jobs, progress=progress, codec=codec, op="push")


def pull(
    dst: Stores,
    src: Stores,
    selectors: Sequence[str],
    *,
    jobs: int = 16,
    progress: TransferProgress | None = None,
    codec: str = KEEP,
) -> TransferReport:
    """Copy the refs ``selectors`` pick from the remote ``src`` into the local ``dst``."""
    return transfer(src, dst, selectors, jobs=jobs, progress=progress, codec=codec, op="pull")


def transfer(
    src: Stores,
    dst: Stores,
    selectors: Sequence[str],
    *,
    jobs: int = 16,
    progress: TransferProgress | None = None,
    codec: str = KEEP,
    op: str = "transfer",
    clock: Callable[[], float] = time.monotonic,
    known: Collection[Digest] | None = None,
) -> TransferReport:
    """Make ``dst`` hold what the selected refs of ``src`` name, and point its refs there.

    ``codec="keep"`` copies stored objects as they are; a codec name (``zstd``, ``raw``,
    ``auto``...) re-encodes each copied chunk for the destination (``cas.objects.recode``), e.g. to
    archive compressed. The whole transfer holds a writer lease on ``dst`` (``cas.refs.leases``), so
    a GC running there spares what it copies, and the refs move only while the lease is live.

    ``known``: chunks ``dst`` held a moment ago (a drain's previous checkpoint). With it, no
    chunk's existence is asked: those in ``known`` count as there (and are refreshed, as every
    chunk found there is, which re-stores one swept since), the rest go up create-only (one
    that is there after all is refreshed instead, and costs its bytes on the wire only).
    """
    with dst.writers.hold(op):
        return _transfer(src, dst, selectors, jobs, progress, codec, op, clock, known)


def _transfer(
    src: Stores,
    dst: Stores,
    selectors: Sequence[str],
    jobs: int,
    progress: TransferProgress | None,
    codec: str,
    op: str,
    clock: Callable[[], float],
    known: Collection[Digest] | None = None,
) -> TransferReport:
    began = clock()
    report = TransferReport(src.url, dst.url)
    report_progress = progress or (lambda moved, skipped: None)
    selected = select_refs(src.refs, dst.refs, selectors)

    manifests: dict[Digest, Manifest] = {}
    for item in selected:
        if item.target not in manifests:
            manifests[item.target] = read_manifest(src, item.target)
    wanted: dict[Digest, int] = {}
    for manifest in manifests.values():
        for ref in manifest.chunk_refs():
            wanted[ref.digest] = ref.size
        for digest in manifest.chunk_digests():
            wanted.setdefault(digest, 0)  # a delta base of unknown size; counted when copied

    if known is None:
        missing_chunks, report.lookup = dst.objects.missing(ObjectKind.CHUNK, list(wanted))
    else:  # a request per chunk saved: the drain knows what its previous checkpoint left there
        missing_chunks, report.lookup = set(wanted).difference(known), "known"
    missing = [d for d in wanted if d in missing_chunks]
    skipped = [d for d in wanted if d not in missing_chunks]
    report.chunks_skipped = len(skipped)
    report.bytes_skipped = sum(wanted[d] for d in skipped)
    report_progress(0, report.bytes_skipped)
    # Touch every skipped chunk so GC's age check spares it while the refs move. A chunk a
    # destination manifest keeps alive today is no exception: the ref naming that manifest may
    # move meanwhile, and the refs this transfer moves would then name a swept chunk. A chunk
    # swept before its touch is stored again by ``_reconcile_chains``.
    dst.objects.freshen(ObjectKind.CHUNK, skipped, jobs)

    allowed = _common_bases(manifests.values())
    copier = _ChunkCopier(
        src, dst, report, report_progress, codec, _element_sizes(manifests), allowed
    )
    copier.copy_all(missing, jobs)
    if copier.unlisted:
        raise _unlisted(op, src.url, selected, manifests, copier.unlisted)
    _reconcile_chains(src, dst, [*skipped, *copier.lost], allowed, report, jobs)
    dst.objects.sync()

    for digest in manifests:
        # One already there may be an unreferenced leftover: the copy refreshes it instead, so
        # GC's age check spares it.
        copied = src.objects.copy(ObjectKind.MANIFEST, digest, dst.objects)
        if copied.created:
            report.manifests_moved += 1
            report.wire_bytes += copied.stored_bytes
        else:
            report.manifests_skipped += 1
    dst.objects.sync()
    report.chunks = frozenset(wanted)

    dst.writers.check()
    for item in selected:
        report.refs.append(_move_ref(dst.refs, item, op, src.url))
    report.seconds = clock() - began
    conflicts = [r for r in report.refs if r.status == "conflict"]
    if conflicts:
        names = ", ".join(r.name for r in conflicts)
        raise TransferConflict(
            f"{len(conflicts)} ref(s) on {dst.url} moved during the {op}: {names}; every "
            "chunk and manifest was copied, so running it again to point them here anyway "
            "moves no data (their other targets stay in the ref history)",
            report,
        )
    return report


def select_refs(src: RefStore, dst: RefStore, selectors: Sequence[str]) -> list[_Selected]:
    """The source refs the selectors name, with their targets on both sides, read now."""
    if not selectors:
        raise NotFound("no refs selected: name refs, prefixes or globs like 'runs/r1/**'")
    names: set[RefName] = set()
    for selector in selectors:
        found = list(src.names(selector))
        if not found:
            raise NotFound(f"no ref matches {selector!r} in {src.url}")
        names.update(found)
    selected = []
    for name in sorted(names):
        record = src.try_get(name)
        if record is None:
            continue  # deleted since it was listed
        remote = dst.try_get(name)
        selected.append(_Selected(name, record.target, remote.target if remote else None))
    if not selected:
        raise NotFound(f"the refs selected by {list(selectors)} vanished from {src.url}")
    return selected


def read_manifest(stores: Stores, digest: Digest) -> Manifest:
    """A manifest of the source, verified and decoded; NotFound naming the store if missing."""
    try:
        return decode_manifest(stores.objects.get_manifest(digest))
    except NotFound as e:
        raise NotFound(f"manifest {digest} is missing from {stores.url}") from e
    except IntegrityError as e:
        raise IntegrityError(f"{e} (in {stores.url})") from e


def _common_bases(manifests: Iterable[Manifest]) -> dict[Digest, set[Digest]]:
    """Chunk -> the bases every one of ``manifests`` that keeps it lists for it."""
    common: dict[Digest, set[Digest]] = {}
    for manifest in manifests:
        for digest, bases in manifest.bases_by_chunk().items():
            common[digest] = bases if digest not in common else common[digest] & bases
    return common


def _unlisted(
    op: str,
    source_url: str,
    selected: Sequence[_Selected],
    manifests: dict[Digest, Manifest],
    unlisted: dict[Digest, Digest],
) -> UnlistedBase:
    """The one-line refusal naming a ref, a chunk and the base its manifest does not list."""
    chunk, base = min(unlisted.items())
    ref = next(
        (
            item.name
            for item in selected
            if base not in manifests[item.target].bases_by_chunk().get(chunk, {base})
        ),
        selected[0].name,
    )
    more = f" (and {len(unlisted) - 1} more such chunks)" if len(unlisted) > 1 else ""
    return UnlistedBase(
        f"{op} refused: ref {ref} in {source_url} needs chunk {chunk}, a delta against base "
        f"{base} that its manifest does not list, so gc would delete that base{more}; no "
        "manifest or ref was published"
    )


def _reconcile_chains(
    src: Stores,
    dst: Stores,
    found: Sequence[Digest],
    allowed: dict[Digest, set[Digest]],
    report: TransferReport,
    jobs: int,
) -> None:
    """Rewrite standalone each chunk ``dst`` already held encoded against a base one of the
    copied manifests does not list for it (``allowed``).

    Manifests are copied byte for byte, so their ``encoding["base"]`` lists the source's chains.
    A chunk the destination stored itself (skipped here, or written by a racing writer first)
    may be a delta against a base only the destination's own manifests keep alive; once those
    are gone, GC would sweep that base from under the copied checkpoint. One header read per
    such chunk finds them; a standalone chunk needs no base. The same read returns a small chunk
    whole, and one whose bytes do not verify is rewritten too, so a push heals it.
    """

    def check(digest: Digest) -> bool:
        # Gone (swept since it was found) or damaged (its header, or a small chunk's bytes,
        # which this same read returns whole): store a good copy.
        sound, base = dst.objects.stored_base(digest)
        if sound and (base is None or base in allowed.get(digest, set())):
            return False
        data = src.objects.get_chunk(digest)  # verified
        dst.objects.put_chunk(data, codec_by_name("zstd"), expected=digest, replace=True)
        return True

    if not found:
        return
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="cas-chains") as pool:
        report.chunks_rewritten += sum(pool.map(check, sorted(set(found))))


class _ChunkCopier:
    """Copies chunk envelopes source -> destination on a thread pool, verifying each one."""

    def __init__(
        self,
        src: Stores,
        dst: Stores,
        report: TransferReport,
        progress: TransferProgress,
        codec: str,
        elem_sizes: dict[Digest, int],
        allowed: dict[Digest, set[Digest]],
    ) -> None:
        self.src = src
        self.dst = dst
        self.report = report
        self.progress = progress
        self.codec = codec
        self.elem_sizes = elem_sizes
        self.allowed = allowed
        self._lock = threading.Lock()
        self.unlisted: dict[Digest, Digest] = {}
        """Copied chunks that are deltas against a base their manifests do not list -> base."""
        self.lost: list[Digest] = []
        """Chunks another writer stored at the destination first (its encoding stayed)."""
        self._beat = dst.writers.beat(None)

    def copy_all(self, digests: Sequence[Digest], jobs: int) -> None:
        """Copy every digest; the first failure stops the rest and is raised as BackendError.

        Every base a copied chunk needs is in ``digests`` or at the destination already when
        its manifests list it; the ones they do not list end up in ``unlisted``.
        """
        if digests:
            self._run(digests, jobs)

    def _run(self, digests: Sequence[Digest], jobs: int) -> None:
        pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="cas-copy")
        futures: list[Future[None]] = []
        try:
            futures = [pool.submit(self._copy_one, d) for d in digests]
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in finished if f.exception() is not None), None)
            if failed is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                self._fail(failed.exception(), len(digests))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)

    def _fail(self, error: BaseException | None, total: int) -> None:
        assert error is not None
        if not isinstance(error, Exception):
            raise error
        where = f"{self.src.url} -> {self.dst.url}"
        summary = (
            f"copy {where} stopped after {self.report.chunks_moved} of {total} missing chunks "
            f"({self.report.bytes_moved} bytes); no destination ref was changed, run it again to "
            f"copy the rest: {type(error).__name__}: {error}"
        )
        if isinstance(error, (IntegrityError, NotFound)):
            raise type(error)(summary) from error
        if isinstance(error, CASError) and not isinstance(error, BackendError):
            raise error
        raise BackendError(summary) from error

    def _copy_one(self, digest: Digest) -> None:
        if self.codec != KEEP:
            self._recode_one(digest)
            return
        # Create-only: a chunk a writer stored at the destination meanwhile, perhaps as a delta
        # against another base that its manifest records, must not be replaced.
        copied = self.src.objects.copy(ObjectKind.CHUNK, digest, self.dst.objects)
        if copied.base is not None and copied.base not in self.allowed.get(digest, set()):
            with self._lock:
                self.unlisted[digest] = copied.base
        self._counted(digest, copied.created, copied.size, copied.stored_bytes)

    def _recode_one(self, digest: Digest) -> None:
        from cas.objects.recode import recode_chunk

        try:
            result = recode_chunk(
                self.src.objects,
                self.dst.objects,
                digest,
                self.codec,
                elem_size=self.elem_sizes.get(digest, 1),
            )
        except NotFound as e:
            raise NotFound(f"chunk {digest} is missing from {self.src.url}") from e
        self._counted(digest, result.new, result.size, result.stored_bytes)

    def _counted(self, digest: Digest, created: bool, size: int, stored: int) -> None:
        """Report one copied chunk: moved, or skipped if another writer stored it first."""
        with self._lock:
            if created:
                self.report.chunks_moved += 1
                self.report.bytes_moved += size
                self.report.wire_bytes += stored
            else:
                self.lost.append(digest)
                self.report.chunks_skipped += 1
                self.report.bytes_skipped += size
        if created:
            self.progress(size, 0)
        else:
            self.progress(0, size)
        if self._beat is not None:
            self._beat(size)


def _element_sizes(manifests: dict[Digest, Manifest]) -> dict[Digest, int]:
    """Each tensor chunk's element size, for byte-grouping codecs when re-encoding."""
    sizes: dict[Digest, int] = {}
    for manifest in manifests.values():
        for tensor in manifest.tensors:
            for ref in tensor.chunks:
                sizes.setdefault(ref.digest, ITEMSIZE.get(tensor.dtype, 1))
    return sizes


def _move_ref(dst: RefStore, item: _Selected, op: str, source_url: str) -> RefUpdate:
    if item.remote_old == item.target:
        return RefUpdate(item.name, item.remote_old, item.target, "unchanged")
    try:
        dst.set(
            item.name, item.target, expected=item.remote_old, op=op, message=f"from {source_url}"
        )
    except RefConflict:
        return RefUpdate(item.name, item.remote_old, item.target, "conflict")
    status = "created" if item.remote_old is None else "updated"
    return RefUpdate(item.name, item.remote_old, item.target, status)
