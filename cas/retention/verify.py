"""Verification: every selected ref's manifest decodes and its chunks exist, or are re-hashed.

Levels, cheapest first: ``structure`` (manifests, refs and their sealed history segments parse),
``existence`` (every chunk a manifest names is present), ``sample`` (re-hash a rotating PCT% of
chunks; successive runs cover the whole store), ``full`` (re-read and re-hash every chunk).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from cas.digest import Digest
from cas.errors import CASError, FormatError, IntegrityError, NotFound
from cas.model.manifest import Manifest, decode_manifest
from cas.objects.chunkio import Progress
from cas.objects.keys import ObjectKind
from cas.refs.stores import Stores

SAMPLE_STATE = "verify-sample.json"
"""The maintenance document holding where the next sampled verification starts."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong, tied to the ref where it was found."""

    ref: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.ref}: {self.kind}: {self.detail}"


@dataclass
class VerifyReport:
    """What a verification looked at and what it found."""

    refs: int = 0
    manifests: int = 0
    chunks: int = 0
    rehashed_chunks: int = 0
    rehashed_bytes: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems


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
    names = sorted({n for s in selectors for n in refs.names(s)})
    sample_start = _sample_start(stores) if level == "sample" else 0.0
    owners: dict[Digest, str] = {}
    seen_manifests: set[Digest] = set()
    for name in names:
        try:
            record = refs.get(name)
        except NotFound:
            continue  # removed since listed, or a fence record standing where no ref is
        except CASError as e:
            report.refs += 1
            report.problems.append(Problem(name, "bad-ref", str(e)))
            continue
        report.refs += 1
        for sealed in record.sealed:
            try:
                refs.segment(record, sealed)
            except CASError as e:
                report.problems.append(Problem(name, "bad-history", str(e)))
        target = record.target
        if target in seen_manifests:
            continue
        seen_manifests.add(target)
        manifest = _read_manifest(stores, name, target, report)
        if manifest is None:
            continue
        report.manifests += 1
        for digest in manifest.chunk_digests():
            owners.setdefault(digest, name)
    if level == "structure":
        return report
    report.chunks = len(owners)
    present = stores.objects.has_many(ObjectKind.CHUNK, owners)
    for digest, ref in owners.items():
        if not present[digest]:
            report.problems.append(Problem(ref, "missing-chunk", digest))
    to_hash = [
        d
        for d in owners
        if present[d]
        and (level == "full" or (level == "sample" and in_sample(d, sample_start, sample_pct)))
    ]
    for digest, outcome in zip(
        to_hash, stores.pool.map(lambda d: _rehash(stores, d), to_hash), strict=False
    ):
        if isinstance(outcome, int):
            report.rehashed_chunks += 1
            report.rehashed_bytes += outcome
            if progress is not None:
                progress(outcome)
        else:
            report.problems.append(Problem(owners[digest], "corrupt-chunk", f"{digest}: {outcome}"))
    if level == "sample":
        _save_sample_start(stores, (sample_start + sample_pct) % 100.0)
    return report


def _read_manifest(
    stores: Stores, ref: str, target: Digest, report: VerifyReport
) -> Manifest | None:
    try:
        return decode_manifest(stores.objects.get_manifest(target))
    except NotFound:
        report.problems.append(Problem(ref, "missing-manifest", target))
    except (IntegrityError, FormatError) as e:
        report.problems.append(Problem(ref, "corrupt-manifest", f"{target}: {e}"))
    return None


def _rehash(stores: Stores, digest: Digest) -> int | str:
    try:
        return stores.objects.verify(digest)
    except CASError as e:
        return str(e)


def _sample_start(stores: Stores) -> float:
    try:
        doc = json.loads(stores.maintenance.read_state(SAMPLE_STATE) or b"{}")
        return float(doc.get("next_start", 0.0)) % 100.0
    except (ValueError, TypeError, AttributeError):
        return 0.0


def _save_sample_start(stores: Stores, start: float) -> None:
    # A read-only store still verifies; the rotation just does not advance.
    with contextlib.suppress(CASError):
        stores.maintenance.write_state(SAMPLE_STATE, json.dumps({"next_start": start}).encode())
