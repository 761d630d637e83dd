"""The Repository's housekeeping: GC, retention, verification, space accounting, stored settings.

``HousekeepingOperations`` is a base class of ``Repository``. The CLI and the training layer plan
and run ``cas gc`` and ``cas forget``, verify, measure space and change the settings stored in
the store's config through these named methods; the work is done by ``cas.retention`` on the
store's ``Stores`` (objects, refs, maintenance service), never on its blobs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cas.blobstore.base import BlobStore
from cas.digest import Digest
from cas.errors import NotFound
from cas.model.manifest import Manifest
from cas.objects.chunkio import Progress
from cas.objects.encoding import standalone_codec
from cas.refs.stores import Stores
from cas.repo.config import WRITER_SETTINGS, StoreConfig, read_config, write_config
from cas.retention.evictions import eviction_logs, read_evictions
from cas.retention.policy import RETENTION_SECTION, RetentionPolicy, protection_of

# Retention plans, GC, verification, repair, space accounting and the status report load on
# first use: a process that only saves and loads (a training job) never pays for their import.
if TYPE_CHECKING:
    from cas.repo.snapshots import SnapshotTaken
    from cas.retention.gc import GCPlan, GCSettings
    from cas.retention.mend import RefRepairReport
    from cas.retention.plan import ForgetPlan, ForgetResult
    from cas.retention.repair import RepairReport
    from cas.retention.space import StoreStats, Usage, UsageIndex, UsageReport
    from cas.retention.status import StoreStatus
    from cas.retention.verify import VerifyReport


class HousekeepingOperations:
    """GC, retention, verification, space accounting and stored settings of a Repository."""

    blobs: BlobStore
    config: StoreConfig
    stores: Stores
    cp: Callable[..., Digest]
    """``Repository.cp``: daily snapshots are subset copies."""

    # -- settings stored in the store's config -------------------------------------------------

    def update_config(self, section: str, value: Any) -> StoreConfig:
        """Replace one ``extra`` section of the store's config (None removes it) and write the
        config durably; return the new config. The format version is the stored one: a process
        that opened the store before `cas migrate` moved it must not move it back."""
        stored = read_config(self.blobs)
        if stored is not None and stored.version > self.config.version:
            self.config = replace(self.config, version=stored.version)
        self.config = self.config.with_extra(section, value)
        write_config(self.blobs, self.config)
        return self.config

    def update_settings(self, **settings: Any) -> StoreConfig:
        """Change the stored writer settings (``codec``, ``compression_level``, ``inline_max``)
        for every later write, by any process that opens the store afterwards; return the new
        config. Chunking (``chunk_size``, ``cdc_avg_size``) is fixed when a store is made."""
        unknown = sorted(set(settings) - set(WRITER_SETTINGS))
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)} cannot be changed in an existing store "
                f"(changeable: {', '.join(WRITER_SETTINGS)})"
            )
        if "codec" in settings:
            standalone_codec(settings["codec"], 1)  # an unknown name is an error here
        stored = read_config(self.blobs) or self.config
        self.config = replace(
            self.config, **settings, version=max(stored.version, self.config.version)
        ).validate()
        write_config(self.blobs, self.config)
        return self.config

    def retention_policy(self) -> RetentionPolicy | None:
        """The retention policy stored in the store, if any (what a plain ``cas forget`` uses)."""
        return RetentionPolicy.from_config(self.config.extra)

    def store_retention_policy(self, policy: RetentionPolicy | None) -> None:
        """Store ``policy`` in the store's config (None removes it)."""
        self.update_config(RETENTION_SECTION, policy.to_dict() if policy is not None else None)

    def ref_protection(self, ref: str) -> str | None:
        """Why replacing ``ref`` needs an explicit overwrite: a gate, a ``best`` pointer or a
        ref the stored retention policy protects (``cas.retention.policy.protection_of``)."""
        return protection_of(ref, self.retention_policy())

    def gc_settings(self) -> GCSettings:
        """The GC grace period and reflog window stored in the store (defaults if none)."""
        from cas.retention.gc import GCSettings

        return GCSettings.from_config(self.config.extra)

    def store_gc_settings(self, settings: GCSettings) -> None:
        """Store the GC defaults ``cas gc`` uses when not told otherwise."""
        from cas.retention.gc import GC_SECTION

        self.update_config(GC_SECTION, settings.to_config())

    # -- garbage collection and retention ------------------------------------------------------

    def plan_gc(
        self,
        settings: GCSettings | None = None,
        *,
        clock: Callable[[], float] | None = None,
        lock: bool = True,
    ) -> GCPlan:
        """What GC would delete now (``cas.retention.gc``); ``plan.execute()`` deletes it.

        ``settings`` default to the stored ones; ``clock`` overrides the store's own clock.
        """
        from cas.retention.gc import plan_gc

        return plan_gc(self.stores, settings or self.gc_settings(), clock=clock, lock=lock)

    def plan_forget(
        self, policy: RetentionPolicy | None = None, *, now: float | None = None
    ) -> ForgetPlan:
        """Which refs ``policy`` (default: the stored one) removes and why; nothing changes
        until ``plan.execute()`` (``cas.retention.plan``), which first takes the policy's
        missing daily snapshots, as ``forget`` does."""
        from cas.retention.plan import plan_forget

        policy = policy or self._stored_policy()
        plan = plan_forget(self.stores, policy, now=now)
        if not policy.snapshots:
            return plan
        return replace(plan, take_snapshots=lambda: self.take_snapshots(policy, now=now))

    def forget(
        self, policy: RetentionPolicy | None = None, *, now: float | None = None
    ) -> ForgetResult:
        """Take the policy's daily snapshots that are missing, then plan and execute ``policy``
        (default: the stored one): remove the refs it drops.

        Chunks are freed by GC afterwards; ``CheckpointManager`` calls this after each save.
        """
        from cas.retention.plan import plan_forget

        self.stores.check_deletes("forget")
        policy = policy or self._stored_policy()
        self.take_snapshots(policy, now=now)  # first, so the plan sees today's snapshots
        return plan_forget(self.stores, policy, now=now).execute()

    def take_snapshots(
        self,
        policy: RetentionPolicy | None = None,
        *,
        now: float | None = None,
        dry_run: bool = False,
    ) -> list[SnapshotTaken]:
        """Make today's weights-only snapshot for each ``DailySnapshot`` of ``policy`` (default:
        the stored one) that lacks one (``cas.repo.snapshots``); ``forget`` does this first."""
        from cas.repo.snapshots import take_daily_snapshots

        policy = policy or self._stored_policy()
        when = self.stores.clock() if now is None else now
        return take_daily_snapshots(self.stores, self.cp, policy, when, dry_run=dry_run)

    def _stored_policy(self) -> RetentionPolicy:
        policy = self.retention_policy()
        if policy is None:
            raise NotFound("the store has no retention policy (`cas policy set`)")
        return policy

    def eviction_logs(self) -> list[str]:
        """Names of the eviction logs retention rules wrote (``cas.retention.evictions``)."""
        return eviction_logs(self.stores.refs)

    def eviction_log(self, name: str) -> list[dict[str, Any]]:
        """Every record of the eviction log ``name``, oldest first."""
        return read_evictions(self.stores.refs, name)

    # -- verification and space ----------------------------------------------------------------

    def verify(
        self,
        selectors: Iterable[str] = ("",),
        *,
        level: str = "existence",
        sample_pct: float = 0.0,
        progress: Progress | None = None,
    ) -> VerifyReport:
        """Check the selected refs (all by default) at ``level`` (``structure``, ``existence``,
        ``sample``, ``full``; ``cas.retention.verify``); never raises for what it finds."""
        from cas.retention.verify import verify

        return verify(self.stores, selectors, level=level, sample_pct=sample_pct, progress=progress)

    def repair_from(
        self,
        source: HousekeepingOperations,
        selectors: Iterable[str] = ("",),
        *,
        progress: Progress | None = None,
    ) -> RepairReport:
        """Verify the selected refs in full and copy every missing or corrupt object from
        ``source`` (another store: an archive, a peer's; ``cas.retention.repair``)."""
        from cas.retention.repair import repair

        return repair(self.stores, source.stores.objects, selectors, progress=progress)

    def repair_refs(
        self, selector: str = "", *, dry_run: bool = False, progress: Progress | None = None
    ) -> RefRepairReport:
        """Rebuild, clean or set aside every damaged ref ``selector`` picks, keeping the bytes of
        every record it changes under ``damaged/`` (``cas.retention.mend``); ``progress(1)``
        per ref checked."""
        from cas.retention.mend import repair_refs

        return repair_refs(self.stores, selector, dry_run=dry_run, progress=progress)

    def status(self, *, clock: Callable[[], float] | None = None, lock: bool = True) -> StoreStatus:
        """The retention report ``cas status`` prints: usage against the stored budget,
        protected refs, oldest and newest checkpoint, each run's latest and best, pending GC
        and quarantine (``cas.retention.status``). Takes the maintenance lock briefly, as
        ``cas gc --dry-run`` does; changes nothing. ``lock=False`` writes nothing at all (a
        read-only view such as ``cas ui``), at the price of a GC figure that a concurrent
        ``cas gc`` may be changing."""
        from cas.retention.status import store_status

        return store_status(
            self.stores, self.retention_policy(), self.gc_settings(), clock=clock, lock=lock
        )

    def disk_usage(self, selector: str = "") -> UsageReport:
        """Logical, stored, exclusive and shared bytes of the refs ``selector`` picks."""
        from cas.retention.space import disk_usage

        return disk_usage(self.stores, selector)

    def usage_index(self) -> UsageIndex:
        """Every readable ref's objects and their counts, read once, for many usage questions
        (each run's own bytes, a checkpoint's exclusive bytes): ``cas.retention.space``."""
        from cas.retention.space import UsageIndex

        return UsageIndex(self.stores)

    def store_stats(self) -> StoreStats:
        """Object counts, and how much dedup and compression save."""
        from cas.retention.space import store_stats

        return store_stats(self.stores)

    def manifest_usage(self, manifest: Manifest, digest: Digest | None = None) -> Usage:
        """Logical and stored bytes of one checkpoint, with and without its delta bases (and
        its stored manifest, given its ``digest``)."""
        from cas.retention.space import manifest_usage

        return manifest_usage(self.stores, manifest, digest)

    def stored_bytes(self, digests: Iterable[Digest]) -> int:
        """Bytes the distinct chunks among ``digests`` occupy in the store (missing ones 0)."""
        from cas.retention.space import stored_bytes

        return stored_bytes(self.stores, digests)
