"""The Repository's transfers: push and pull refs between stores, archive and drain them to a remote.

``TransferOperations`` is a base class of ``Repository``. The CLI moves checkpoints between
stores through these named methods; ``cas.sync.transfer`` does the work on both sides' ``Stores``
and ``cas.repo.archive`` adds freeing what was archived.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING

from cas.digest import Digest
from cas.objects.recode import KEEP
from cas.refs.stores import Stores
from cas.repo.config import StoreConfig
from cas.sync.drain import (
    DrainReport,
    PendingCheckpoint,
    TierLag,
    drain_checkpoint,
    pending_checkpoints,
    tier_lag,
)
from cas.sync.transfer import TransferProgress, TransferReport, pull, push

if TYPE_CHECKING:
    from cas.repo.archive import ArchiveReport  # with GC: loaded by the first archive


class TransferOperations:
    """Push, pull and archive of a Repository."""

    stores: Stores
    config: StoreConfig

    def push(
        self,
        remote: TransferOperations,
        selectors: Sequence[str],
        *,
        jobs: int = 16,
        progress: TransferProgress | None = None,
        codec: str = KEEP,
    ) -> TransferReport:
        """Copy the refs ``selectors`` pick (names, prefixes, globs like ``runs/r1/**``) to
        ``remote``: only the chunks it lacks, then its refs by compare-and-swap
        (``cas.sync.transfer``). ``codec`` re-encodes chunks for the remote (``keep``: as
        stored)."""
        return push(
            self.stores, remote.stores, selectors, jobs=jobs, progress=progress, codec=codec
        )

    def pull(
        self,
        remote: TransferOperations,
        selectors: Sequence[str],
        *,
        jobs: int = 16,
        progress: TransferProgress | None = None,
        codec: str = KEEP,
    ) -> TransferReport:
        """Copy the refs ``selectors`` pick from ``remote`` into this store (as ``push``)."""
        return pull(
            self.stores, remote.stores, selectors, jobs=jobs, progress=progress, codec=codec
        )

    def archive(
        self,
        remote: TransferOperations,
        selectors: Sequence[str],
        *,
        jobs: int = 16,
        progress: TransferProgress | None = None,
        grace: float = 0.0,
        codec: str = KEEP,
    ) -> ArchiveReport:
        """Push ``selectors`` to ``remote``, remove them here, and free the local chunks no
        remaining ref needs (``cas.repo.archive``)."""
        from cas.repo.archive import archive
        from cas.retention.gc import GCSettings

        return archive(
            self.stores,
            remote.stores,
            selectors,
            settings=GCSettings.from_config(self.config.extra),
            jobs=jobs,
            progress=progress,
            grace=grace,
            codec=codec,
        )

    def pending_on(
        self,
        remote: TransferOperations,
        selector: str,
        absent: Mapping[str, Digest] | None = None,
        present: MutableMapping[str, Digest] | None = None,
    ) -> list[PendingCheckpoint]:
        """The refs ``selector`` picks here that ``remote`` lacks or holds at another manifest,
        oldest first; those ``absent`` or ``present`` names at their target are not asked for,
        and ``present`` is kept up to date (``cas.sync.drain.pending_checkpoints``)."""
        return pending_checkpoints(self.stores, remote.stores, selector, absent, present)

    def drain_to(
        self,
        remote: TransferOperations,
        ref: str | None,
        *,
        latest: str | None,
        pointers: Sequence[str] = (),
        hold_back: Collection[Digest] = (),
        jobs: int = 16,
        known: Collection[Digest] | None = None,
    ) -> DrainReport:
        """Push one checkpoint ``ref`` to ``remote``, then move its ``latest`` and ``pointers``
        there in that order, fenced by one writer lease (``cas.sync.drain``); ``known``: chunks
        ``remote`` held a moment ago, whose existence is then not asked."""
        return drain_checkpoint(
            self.stores,
            remote.stores,
            ref,
            latest=latest,
            pointers=pointers,
            hold_back=hold_back,
            jobs=jobs,
            known=known,
        )

    def tier_lag(self, remote: TransferOperations, selector: str) -> TierLag:
        """How far ``remote`` is behind this store for the refs ``selector`` picks."""
        return tier_lag(self.stores, remote.stores, selector)
