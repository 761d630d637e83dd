"""What a CheckpointManager save is on its way: prepared (copied), pending (writing), committed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from cas.digest import Digest
from cas.sync.drain import TierLag
from cas.training.async_save import StagingSet
from cas.training.history import HistoryRecord, plain_record


@dataclass(frozen=True)
class SaveResult:
    """A committed checkpoint."""

    step: int
    phase: int
    ref: str
    digest: Digest
    trigger: str
    status: str
    is_best: bool
    blocking_seconds: float
    write_seconds: float
    logical_bytes: int
    new_bytes: int
    retention_error: str | None = None
    """Why the retention policy did not run after this save (it is committed all the same)."""
    mirror_error: str | None = None
    """Why ``best``, moved to this save, was not pushed to the mirror store."""
    retention_damaged: tuple[str, ...] = ()
    """Refs the retention policy kept after this save because they cannot be read (damaged
    record or manifest): outside its count, never removed; ``cas repair`` or ``cas rm``."""

    remote_lag: TierLag | None = None
    """With a remote tier: the saves (this one included) and bytes not yet there, and since when."""

    @property
    def retention_ran(self) -> bool:
        """Whether the policy ran fully after this save (no error, nothing damaged in its way)."""
        return self.retention_error is None and not self.retention_damaged


def retention_note(step: int, error: str | None, damaged: tuple[str, ...]) -> dict[str, Any] | None:
    """What the next checkpoint's meta records (``retention``) about the policy's run after save
    ``step``, so ``cas status`` can show a run whose retention fell behind; None when it ran."""
    if error is None and not damaged:
        return None
    return {"after_step": step, "error": error, "damaged": list(damaged)}


class PendingSave:
    """A save whose copy is taken; ``result()`` waits for it to be committed."""

    def __init__(self, future: Future[SaveResult], step: int, ref: str, blocking: float) -> None:
        self.future = future
        self.step = step
        self.ref = ref
        self.blocking_seconds = blocking

    def done(self) -> bool:
        """Whether the save has been committed (or failed)."""
        return self.future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait for the commit; re-raise its failure."""
        return self.future.result(timeout)


@dataclass
class PreparedSave:
    """A save whose state is copied: what the background writer commits."""

    tree: dict[str, Any]
    meta: dict[str, Any]
    ref: str
    step: int
    phase: int
    trigger: str
    status: str
    records: list[HistoryRecord]
    staging: StagingSet | None
    blocking: float = 0.0


RESERVED_META = frozenset(
    {"cas_checkpoint", "run", "phase", "step", "trigger", "status", "metrics", "seed",
     "saved_at", "config_hash", "config", "system_hash", "schema_version", "retention"}
)  # fmt: skip
"""The manifest meta keys the manager writes itself; ``metadata=`` may not use them."""


def user_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """``save(metadata=...)`` as plain data; a key the manager owns is a ValueError."""
    if not metadata:
        return {}
    taken = sorted(k for k in metadata if k in RESERVED_META)
    if taken:
        raise ValueError(
            f"metadata keys {', '.join(taken)} are the manager's own; pick other names"
        )
    plain = plain_record(0, metadata, what="metadata")
    plain.pop("step")
    return plain


def beats_best(value: float, current: float, mode: str) -> bool:
    """Whether a metric ``value`` replaces the ``current`` best under ``"min"`` or ``"max"``
    (anything beats a NaN best)."""
    if math.isnan(current):
        return True
    return value < current if mode == "min" else value > current
