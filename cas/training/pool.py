"""Opponent pool: versioned inference-only models with ratings, FIFO eviction and seeded sampling.

A league's opponent pool, as refs under one prefix::

    <prefix>/pool_v<version:04d>_step<step:08d>   one model; its manifest meta "pool" holds
                                                  version, step, phase, mu, sigma, games,
                                                  win_rate, anchor, name, promoted_at
    <prefix>/counter                              the next version, moved by compare-and-swap
    <prefix>/evictions                            the eviction log (an append log, cas.refs.log)

Versions come from the counter ref, claimed by compare-and-swap before the model is named, so they
are unique across processes and restarts and never reused, even after eviction. Re-rating writes a
new manifest with the same tensor entries and new meta: no chunk is written. When more than
``capacity`` non-anchor models are in the pool the oldest are evicted; their last metadata is
appended to the eviction log first, so a crash never loses a rating history (a model re-rated
while it was being evicted is logged again; ``evictions`` keeps its last rating, in the place of
its first). Anchors are never evicted and never re-rated. ``sample(count, seed)`` is a pure
function of the seed and the roster.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cas.digest import Digest, digest_of
from cas.errors import CASError, FormatError, NotFound
from cas.model.manifest import Manifest
from cas.model.subset import subset_manifest
from cas.refs.listing import DamagedRef
from cas.refs.log import AppendLog
from cas.refs.records import RefRecord
from cas.refs.store import RefChange

if TYPE_CHECKING:
    import torch

    from cas.repo.repository import Repository

log = logging.getLogger(__name__)
ENTRY_RE = re.compile(r"pool_v(\d+)_step(\d+)\Z")
EVICTIONS_KIND = "pool-evictions"
RATING_FIELDS = ("mu", "sigma", "games", "win_rate")


class FrozenAnchor(CASError):
    """Anchors keep the rating they were promoted with; they are never re-rated or evicted."""


@dataclass(frozen=True)
class PoolEntry:
    """One pool model, as described by its manifest's ``pool`` meta (no weights are read)."""

    version: int
    ref: str
    digest: Digest
    step: int
    phase: int | None = None
    mu: float | None = None
    sigma: float | None = None
    games: int = 0
    win_rate: float | None = None
    anchor: bool = False
    name: str | None = None
    promoted_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def conservative_rating(self) -> float | None:
        """``mu - 3 sigma``: a conservative rating that ranks an opponent by what it surely achieves."""
        if self.mu is None or self.sigma is None:
            return None
        return self.mu - 3 * self.sigma

    def meta(self) -> dict[str, Any]:
        """The ``pool`` meta this entry is stored with."""
        return {
            **self.extra,
            "version": self.version, "step": self.step, "phase": self.phase, "mu": self.mu,
            "sigma": self.sigma, "games": self.games, "win_rate": self.win_rate,
            "anchor": self.anchor, "name": self.name, "promoted_at": self.promoted_at,
        }  # fmt: skip


def _entry_from(ref: str, digest: Digest, pool_meta: Mapping[str, Any]) -> PoolEntry:
    known = {"version", "step", "phase", "mu", "sigma", "games", "win_rate", "anchor", "name",
             "promoted_at"}  # fmt: skip
    try:
        return PoolEntry(
            version=int(pool_meta["version"]),
            ref=ref,
            digest=digest,
            step=int(pool_meta.get("step", 0)),
            phase=pool_meta.get("phase"),
            mu=pool_meta.get("mu"),
            sigma=pool_meta.get("sigma"),
            games=int(pool_meta.get("games") or 0),
            win_rate=pool_meta.get("win_rate"),
            anchor=bool(pool_meta.get("anchor", False)),
            name=pool_meta.get("name"),
            promoted_at=float(pool_meta.get("promoted_at", 0.0)),
            extra={k: v for k, v in pool_meta.items() if k not in known},
        )
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"pool entry {ref} has malformed pool metadata: {e}") from e


def _is_entry(ref: str) -> bool:
    return ENTRY_RE.match(ref.rsplit("/", 1)[-1]) is not None


def _version_in(ref: str) -> int:
    match = ENTRY_RE.match(ref.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else 0


class OpponentPool:
    """The pool under ``prefix``; see the module docstring."""

    def __init__(
        self,
        repo: Repository,
        prefix: str,
        *,
        capacity: int = 20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.repo = repo
        self.prefix = prefix.rstrip("/")
        self.capacity = capacity
        self.clock = clock
        self._manifests: dict[Digest, Manifest] = {}
        self._eviction_log: AppendLog = repo.append_log(self.eviction_log_ref, EVICTIONS_KIND)
        self.damaged: tuple[DamagedRef, ...] = ()
        """Entries the last ``entries()`` left out because they cannot be read."""

    @property
    def counter_ref(self) -> str:
        """The ref holding the next version number."""
        return f"{self.prefix}/counter"

    @property
    def eviction_log_ref(self) -> str:
        """The ref holding the eviction log."""
        return f"{self.prefix}/evictions"

    def _manifest(self, digest: Digest) -> Manifest:
        manifest = self._manifests.get(digest)
        if manifest is None:
            manifest = self.repo.manifest(digest)
            self._manifests[digest] = manifest
        return manifest

    def _entry(self, ref: str, digest: Digest) -> PoolEntry:
        meta = self._manifest(digest).meta.get("pool")
        if not isinstance(meta, Mapping):
            raise FormatError(f"{ref} has no pool metadata")
        return _entry_from(ref, digest, meta)

    def entries(self, *, include_anchors: bool = True) -> list[PoolEntry]:
        """Every model in the pool, oldest version first; reads manifests, never weights.

        An entry whose ref or manifest cannot be read is left out, never evicted, and listed in
        ``damaged`` (its version is never handed out again); ``cas repair`` or ``cas rm``."""
        out = []
        listing = self.repo.list_refs(f"{self.prefix}/")
        damaged = [d for d in listing.damaged if _is_entry(d.ref)]
        for record in listing.records:
            if not _is_entry(record.name):
                continue
            try:
                entry = self._entry(record.name, record.target)
            except CASError as e:  # a damaged manifest: kept, outside the capacity
                damaged.append(DamagedRef(record.name, str(e)))
                continue
            if include_anchors or not entry.anchor:
                out.append(entry)
        if damaged and damaged != list(self.damaged):
            log.warning("pool %s: damaged entries kept: %s", self.prefix, damaged)
        self.damaged = tuple(damaged)
        return sorted(out, key=lambda e: e.version)

    def get(self, version: int) -> PoolEntry:
        """The entry with ``version``; NotFound if it is not (or no longer) in the pool."""
        for entry in self.entries():
            if entry.version == version:
                return entry
        raise NotFound(f"pool {self.prefix} has no version {version} (evicted or never promoted)")

    def load(
        self, version: int, *, keys: str | Sequence[str] | None = None,
        map_location: str | torch.device | None = None,
    ) -> Any:  # fmt: skip
        """The weights of one version (verified on read)."""
        entry = self.get(version)
        meta = self._manifest(entry.digest).meta
        prefixed = keys
        if keys is not None and meta.get("cas_checkpoint"):
            prefixed = [f"state.{k}" for k in ([keys] if isinstance(keys, str) else keys)]
        tree = self.repo.load(entry.digest, map_location=map_location, keys=prefixed)
        if meta.get("cas_checkpoint") and isinstance(tree, dict):
            return tree.get("state")
        return tree

    def next_version(self) -> int:
        """The version the next promotion will get."""
        return self._read_counter(self.repo.find_ref(self.counter_ref))

    def _read_counter(self, record: RefRecord | None = None) -> int:
        stored = 1
        if record is not None:
            stored = int(self._manifest(record.target).meta.get("next_version", 1))
        # The counter is the authority; existing names and the log only guard against a counter
        # that was deleted by hand, so a version is never handed out twice.
        seen = [e.version for e in self.entries()] + [int(v["version"]) for v in self.evictions()]
        seen += [_version_in(d.ref) for d in self.damaged]
        return max([stored, *(v + 1 for v in seen)])

    def _claim_version(self) -> int:
        claimed = 0

        def claim(current: RefRecord | None) -> Digest:
            nonlocal claimed
            claimed = self._read_counter(current)
            return self.repo.put_manifest(
                Manifest(
                    kind="state", tensors=(), tree=None, created_at=self.clock(),
                    parent=current.target if current else None,
                    meta={"cas_pool_counter": 1, "next_version": claimed + 1},
                )
            )  # fmt: skip

        self.repo.update_ref(self.counter_ref, claim, op="pool-claim", overwrite=True)
        return claimed

    def promote(
        self,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
        *,
        step: int = 0,
        phase: int | None = None,
        only: str | Sequence[str] | None = None,
        anchor: bool = False,
        name: str | None = None,
    ) -> PoolEntry:
        """Add a model with the next version, then evict beyond ``capacity``.

        ``state`` is either the weights to store or a ref/digest to copy (``only`` keeps matching
        entries, e.g. ``"state.model.*"`` from a manager checkpoint): a copy writes no chunk.
        ``metadata`` may carry ``mu``, ``sigma``, ``games``, ``win_rate`` and any plain extras.
        """
        extra = dict(metadata or {})
        version = self._claim_version()
        entry = PoolEntry(
            version=version, ref=f"{self.prefix}/pool_v{version:04d}_step{step:08d}",
            digest=Digest(""), step=step, phase=phase, mu=extra.pop("mu", None),
            sigma=extra.pop("sigma", None), games=int(extra.pop("games", 0) or 0),
            win_rate=extra.pop("win_rate", None), anchor=anchor, name=name,
            promoted_at=self.clock(), extra=extra,
        )  # fmt: skip
        if isinstance(state, str):
            source_digest = self.repo.resolve(state)
            source = self.repo.manifest(source_digest)
            if only is not None:
                patterns = [only] if isinstance(only, str) else list(only)
                source = subset_manifest(
                    source, patterns, parent=source_digest, created_at=self.clock()
                )
            manifest = replace(
                source, meta={**source.meta, "pool": entry.meta()}, parent=source_digest,
                created_at=self.clock(),
            )  # fmt: skip
            digest = self.repo.commit(manifest, entry.ref, expected=None, op="pool-promote")
        else:
            digest = self.repo.save(state, entry.ref, {"pool": entry.meta()}, expected=None)
        entry = replace(entry, digest=digest)
        if not anchor:
            self.evict()
        return entry

    def add_anchor(
        self, source: Any, name: str, metadata: Mapping[str, Any] | None = None, **kw: Any
    ) -> PoolEntry:
        """A frozen pool member (e.g. a run's ``runs/<id>/gates/bc_best``): never evicted, never re-rated."""
        return self.promote(source, metadata, anchor=True, name=name, **kw)

    def update(self, version: int, **fields: Any) -> PoolEntry:
        """Re-rate one model (``mu``, ``sigma``, ``games``, ``win_rate``, extras) without its weights."""
        if fields.keys() & {"version", "anchor", "step"}:
            raise ValueError("a pool entry's version, step and anchor flag never change")
        ref = self.get(version).ref
        rated: PoolEntry | None = None

        def rerate(current: RefRecord | None) -> Digest:
            nonlocal rated
            if current is None:
                raise NotFound(f"pool {self.prefix} has no version {version} (evicted meanwhile)")
            entry = self._entry(ref, current.target)
            if entry.anchor:
                raise FrozenAnchor(
                    f"pool v{version} ({entry.name}) is an anchor; its rating is fixed"
                )
            meta = entry.meta()
            meta.update(fields)
            old = self._manifest(entry.digest)
            digest = self.repo.put_manifest(
                replace(
                    old, meta={**old.meta, "pool": meta}, parent=entry.digest,
                    created_at=self.clock(),
                )
            )  # fmt: skip
            rated = _entry_from(ref, digest, meta)
            return digest

        # The pool's own rating of its own entry (anchors refuse above): an explicit move.
        self.repo.update_ref(ref, rerate, op="pool-rate", overwrite=True)
        assert rated is not None
        return rated

    def evictions(self) -> list[dict[str, Any]]:
        """The eviction log: the last metadata of every evicted model, oldest first.

        A model re-rated while it was being evicted was logged twice; it appears once, with its
        last rating, where it was first logged.
        """
        latest: dict[int, dict[str, Any]] = {}
        for item in self._eviction_log.records():
            if not isinstance(item, dict) or "version" not in item:
                raise FormatError(f"{self.eviction_log_ref} holds a record that is not an eviction")
            latest[int(item["version"])] = dict(item)  # a re-logged version keeps its place
        return list(latest.values())

    def evict(self) -> list[PoolEntry]:
        """Remove the oldest non-anchor models beyond ``capacity``; return what was removed."""
        members = self.entries(include_anchors=False)
        excess = members[: max(0, len(members) - self.capacity)]
        removed = []
        for entry in excess:
            removed.append(self._evict_one(entry))
        return removed

    def _evict_one(self, entry: PoolEntry) -> PoolEntry:
        """Log ``entry`` and delete its ref; if it was re-rated meanwhile, the delete loses its
        compare-and-swap and the entry is logged again with its latest rating first."""
        evicted = entry

        def log_then_remove(current: RefRecord | None) -> RefChange:
            nonlocal evicted
            if current is None:
                return RefChange.KEEP  # another process evicted it; the log has it
            evicted = self._entry(entry.ref, current.target)
            self._log_eviction(evicted)
            return RefChange.DELETE

        self.repo.update_ref(entry.ref, log_then_remove, op="pool-evict")
        return evicted

    def _log_eviction(self, entry: PoolEntry) -> None:
        item = {**entry.meta(), "ref": entry.ref, "digest": entry.digest,
                "evicted_at": self.clock()}  # fmt: skip
        self._eviction_log.append(
            [item],
            op="pool-evict",
            message=entry.ref,
            unique=lambda logged: (int(logged["version"]), logged.get("digest")),
            lookback=None,
        )

    def sample(
        self, count: int, seed: int, *, start: int = 0, include_anchors: bool = True
    ) -> list[PoolEntry]:
        """``count`` opponents drawn uniformly with replacement, a pure function of the seed.

        Draw ``i`` depends only on ``seed``, ``i`` and the roster (ordered by version), so the
        same seed and pool give the same matchups on any machine; ``start`` continues a stream.
        """
        roster = self.entries(include_anchors=include_anchors)
        if not roster:
            raise NotFound(f"pool {self.prefix} is empty")
        picks = []
        for draw in range(start, start + count):
            value = int(digest_of(f"cas-pool-sample:{seed}:{draw}".encode())[:16], 16)
            picks.append(roster[value % len(roster)])
        return picks
