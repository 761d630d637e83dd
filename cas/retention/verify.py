"""Verification: every selected ref's manifest decodes and its chunks exist, or are re-hashed.

Levels, cheapest first: ``structure`` (manifests, refs and their sealed history segments parse),
``existence`` (every chunk a manifest names is present, the decoded size its header declares is
the size every manifest entry gives it, and the delta base it declares, if any, is one the
manifest lists for it: one small ranged read per chunk, about what an existence request costs),
``sample`` (re-hash a rotating PCT% of chunks; successive runs cover the whole store), ``full``
(re-read and re-hash every chunk, and compare its decoded size with every entry naming it).

A chunk whose size disagrees with an entry is a ``size-mismatch``: at ``full`` the chunk hashes
to its name, so the manifest is what is wrong (a reader refuses it); at ``existence`` the header
may be. A chunk that is a delta against a base its manifest does not list is an
``unlisted-base``: GC reads manifests only (invariant 4), so it would delete that base and break
the checkpoint, although it loads today. Chunks and manifests found corrupt are quarantined by
the object store as they are read (``cas.objects.quarantine``), and each problem names every ref
it breaks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cas.digest import Digest
from cas.errors import CASError, FormatError, IntegrityError, NotFound
from cas.model.bounded import load_record_json
from cas.model.manifest import Manifest, decode_manifest
from cas.objects.chunkio import Progress
from cas.refs.listing import list_refs
from cas.refs.stores import Stores

SAMPLE_STATE = "verify-sample.json"
"""The maintenance document holding where the next sampled verification starts."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong, tied to the ref where it was found (and every ref it breaks)."""

    ref: str
    kind: str
    detail: str
    digest: str = ""
    """The object at fault (a chunk or manifest digest), when there is one."""
    refs: tuple[str, ...] = ()
    """Every selected ref the problem breaks, ``ref`` first."""

    def __str__(self) -> str:
        more = f" (and {len(self.refs) - 1} more refs)" if len(self.refs) > 1 else ""
        return f"{self.ref}: {self.kind}: {self.detail}{more}"


@dataclass
class VerifyReport:
    """What a verification looked at and what it found."""

    refs: int = 0
    manifests: int = 0
    chunks: int = 0
    rehashed_chunks: int = 0
    rehashed_bytes: int = 0
    quarantined: int = 0
    """Objects of the store held in quarantine (found corrupt at some time, by any reader)."""
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    def broken_refs(self) -> list[str]:
        """Every ref some problem breaks, sorted."""
        return sorted({r for p in self.problems for r in (p.refs or (p.ref,))})


def in_sample(digest: Digest, start: float, pct: float) -> bool:
    """Whether a chunk falls in the window ``[start, start+pct)`` of the 0-100 digest ring."""
    position = (int(digest[:8], 16) % 10000) / 100.0
    return (position - start) % 100.0 < pct


def verify(
    stores: Stores,
    selectors: Iterable[str] = ("",),
    *,
    level: str = "existence",
    sample_pct: float = 0.0,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check the selected refs (all by default) at ``level``; never raises for what it finds."""
    if level not in ("structure", "existence", "sample", "full"):
        raise ValueError(f"unknown verify level {level!r}")
    report = VerifyReport()
    refs = stores.refs
    # Every ref blob is read, so a damaged one, even one whose name cannot be read, is a problem.
    listings = [list_refs(refs, s) for s in selectors]
    records = {r.name: r for listing in listings for r in listing.records}
    damaged = {d.ref: d for listing in listings for d in listing.damaged}
    sample_start = _sample_start(stores) if level == "sample" else 0.0
    named_by: dict[Digest, list[str]] = {}  # the refs naming each manifest
    chunks: dict[Digest, _Claims] = {}
    manifest_problems: list[tuple[Digest, str, str]] = []
    for bad in sorted(damaged.values(), key=lambda d: d.ref):
        report.refs += 1
        report.problems.append(Problem(bad.ref, "bad-ref", bad.error))
    for name, record in sorted(records.items()):
        report.refs += 1
        for problem in record.problems():  # readable around it, but damage all the same
            report.problems.append(Problem(name, "bad-history", problem))
        for sealed in record.sealed:
            try:
                refs.segment(record, sealed)
            except CASError as e:
                report.problems.append(Problem(name, "bad-history", str(e)))
        target = record.target
        if target in named_by:
            named_by[target].append(name)
            continue
        named_by[target] = [name]
        manifest = _read_manifest(stores, target, manifest_problems)
        if manifest is None:
            continue
        report.manifests += 1
        _claim(chunks, target, manifest)
    for target, kind, detail in manifest_problems:
        who = tuple(named_by[target])
        report.problems.append(Problem(who[0], kind, detail, target, who))
    if level == "structure":
        report.quarantined = stores.objects.quarantine.summary().objects
        return report

    def broken(digest: Digest, kind: str, detail: str, sizes: Iterable[int] | None = None) -> None:
        claims = chunks[digest]
        manifests = claims.manifests if sizes is None else claims.manifests_of(sizes)
        who = tuple(dict.fromkeys(r for m in manifests for r in named_by[m]))
        report.problems.append(Problem(who[0], kind, detail, digest, who))

    report.chunks = len(chunks)
    headers = dict(zip(chunks, stores.pool.map(_declared(stores), chunks), strict=True))
    declared: dict[Digest, int | CASError] = {}
    for digest, outcome in headers.items():
        declared[digest] = outcome if isinstance(outcome, CASError) else outcome[0]
        if isinstance(outcome, CASError):
            missing = isinstance(outcome, NotFound)
            kind, detail = (
                ("missing-chunk", digest) if missing else ("corrupt-chunk", f"{digest}: {outcome}")
            )
            broken(digest, kind, detail)
            continue
        size, base = outcome
        if level != "full" and (wrong := chunks[digest].disagreeing(size)):
            detail = f"{digest}: its header declares {size} bytes, {_entries(wrong)}"
            broken(digest, "size-mismatch", detail, wrong)
        if base is not None and (unlisting := chunks[digest].unlisting(base)):
            who = tuple(dict.fromkeys(r for m in unlisting for r in named_by[m]))
            detail = (
                f"{digest} is a delta against {base}, which the manifest does not list, so gc "
                "would delete that base"
            )
            report.problems.append(Problem(who[0], "unlisted-base", detail, digest, who))
    to_hash = [
        d
        for d in chunks
        if isinstance(declared[d], int)
        and (level == "full" or (level == "sample" and in_sample(d, sample_start, sample_pct)))
    ]
    for digest, rehashed in zip(
        to_hash, stores.pool.map(lambda d: _rehash(stores, d), to_hash), strict=False
    ):
        if isinstance(rehashed, int):
            report.rehashed_chunks += 1
            report.rehashed_bytes += rehashed
            if progress is not None:
                progress(rehashed)
            if level == "full" and (wrong := chunks[digest].disagreeing(rehashed)):
                detail = f"{digest}: the chunk holds {rehashed} bytes, {_entries(wrong)}"
                broken(digest, "size-mismatch", detail, wrong)
        else:
            broken(digest, "corrupt-chunk", f"{digest}: {rehashed}")
    if level == "sample":
        _save_sample_start(stores, (sample_start + sample_pct) % 100.0)
    report.quarantined = stores.objects.quarantine.summary().objects  # this run's finds too
    return report


@dataclass
class _Claims:
    """Which manifests name one chunk, and the decoded sizes their entries give it."""

    manifests: list[Digest] = field(default_factory=list)
    sizes: dict[int, list[Digest]] = field(default_factory=dict)
    """Size -> the manifests with an entry of that size (delta bases carry no size)."""
    bases: dict[Digest, set[Digest]] = field(default_factory=dict)
    """Manifest -> the delta bases it lists for the chunk (GC keeps those, and only those)."""

    def unlisting(self, base: Digest) -> list[Digest]:
        """The manifests that keep the chunk but not ``base``, the base its header declares."""
        return [m for m in self.manifests if base not in self.bases.get(m, set())]

    def disagreeing(self, size: int) -> list[int]:
        """The sizes entries give the chunk other than ``size``, its real (or declared) one."""
        return sorted(s for s in self.sizes if s != size)

    def manifests_of(self, sizes: Iterable[int]) -> list[Digest]:
        """The manifests with an entry of one of ``sizes``."""
        return list(dict.fromkeys(m for s in sizes for m in self.sizes[s]))


def _claim(chunks: dict[Digest, _Claims], target: Digest, manifest: Manifest) -> None:
    for digest, bases in manifest.bases_by_chunk().items():
        claims = chunks.setdefault(digest, _Claims())
        claims.manifests.append(target)
        claims.bases[target] = bases
    for ref in manifest.chunk_refs():
        named = chunks[ref.digest].sizes.setdefault(ref.size, [])
        if not named or named[-1] != target:
            named.append(target)


def _entries(sizes: list[int]) -> str:
    said = " or ".join(str(s) for s in sizes)
    return f"a manifest entry says {said}"


def _declared(stores: Stores) -> Callable[[Digest], tuple[int, Digest | None] | CASError]:
    def declared(digest: Digest) -> tuple[int, Digest | None] | CASError:
        try:
            return stores.objects.declared(digest)
        except CASError as e:
            return e

    return declared


def _read_manifest(
    stores: Stores, target: Digest, problems: list[tuple[Digest, str, str]]
) -> Manifest | None:
    try:
        return decode_manifest(stores.objects.get_manifest(target))
    except NotFound:
        problems.append((target, "missing-manifest", target))
    except (IntegrityError, FormatError) as e:
        problems.append((target, "corrupt-manifest", f"{target}: {e}"))
    return None


def _rehash(stores: Stores, digest: Digest) -> int | str:
    try:
        return stores.objects.verify(digest)
    except CASError as e:
        return str(e)


def _sample_start(stores: Stores) -> float:
    try:
        doc = load_record_json(stores.maintenance.read_state(SAMPLE_STATE) or b"{}", "sample")
        return float(doc.get("next_start", 0.0)) % 100.0
    except (FormatError, ValueError, TypeError, AttributeError):
        return 0.0


def _save_sample_start(stores: Stores, start: float) -> None:
    # A read-only store still verifies; the rotation just does not advance.
    with contextlib.suppress(CASError):
        stores.maintenance.write_state(SAMPLE_STATE, json.dumps({"next_start": start}).encode())
