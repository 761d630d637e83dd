"""User schema versions: a checkpoint saved by older training code is migrated step by step on
restore, and one saved by newer code is refused.

``CheckpointManager(schema_version=3, migrations={1: v1_to_v2, 2: v2_to_v3})`` stores
``schema_version`` in every checkpoint's meta. On restore, a checkpoint of version 1 is passed
through ``v1_to_v2`` and then ``v2_to_v3`` (each receives the user's state tree, as loaded, and
returns the next version's) before anything else sees it. The refusal of a newer checkpoint
happens before its tensors are read, and is never skipped for an older checkpoint: resuming a run
that newer code continued from where older code left off would silently lose the newer steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cas.errors import CASError

SCHEMA_KEY = "schema_version"
"""The manifest meta key that holds a checkpoint's user schema version."""
UNVERSIONED = 1
"""The version of a checkpoint saved without ``schema_version`` (before the code had one)."""

Migration = Callable[[Any], Any]
"""Takes the state tree of schema version N and returns the tree of version N + 1."""


class SchemaMismatch(CASError):
    """A checkpoint's schema version is newer than the code's, or no migration reaches it."""


@dataclass(frozen=True)
class UserSchema:
    """The code's schema version (None: unversioned, nothing stored or checked) and the
    migrations by the version each one moves from."""

    version: int | None = None
    migrations: Mapping[int, Migration] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.version is None:
            if self.migrations:
                raise ValueError("migrations= needs schema_version=")
            return
        if type(self.version) is not int or self.version < 1:
            raise ValueError(f"schema_version must be an int >= 1, got {self.version!r}")
        for step, fn in self.migrations.items():
            if type(step) is not int or not 1 <= step < self.version:
                raise ValueError(
                    f"migrations key {step!r}: a migration moves from a version in "
                    f"1..{self.version - 1} to the next"
                )
            if not callable(fn):
                raise ValueError(f"migrations[{step}] is not callable")

    def meta(self) -> dict[str, Any]:
        """What a save records: the schema version, when the code has one."""
        return {} if self.version is None else {SCHEMA_KEY: self.version}

    def saved_version(self, ref: str, meta: Mapping[str, Any]) -> int:
        """The schema version ``ref`` was saved with (``UNVERSIONED`` when it has none)."""
        saved = meta.get(SCHEMA_KEY, UNVERSIONED)
        if type(saved) is not int or saved < 1:
            raise SchemaMismatch(f"{ref} has an invalid schema version {saved!r:.40}")
        return saved

    def check(self, ref: str, meta: Mapping[str, Any]) -> None:
        """Raise SchemaMismatch unless ``ref`` can be brought to the code's schema version: it
        is not newer, and a migration exists for every step from its version."""
        if self.version is None:
            return
        saved = self.saved_version(ref, meta)
        if saved > self.version:
            raise SchemaMismatch(
                f"cannot restore {ref}: it was saved with schema version {saved}, newer than "
                f"this code's {self.version}. Restore it with the code that wrote it, or start "
                "from an older checkpoint with source="
            )
        missing = [v for v in range(saved, self.version) if v not in self.migrations]
        if missing:
            raise SchemaMismatch(
                f"cannot restore {ref}: it has schema version {saved} and there is no migration "
                f"from version {missing[0]} to {missing[0] + 1} (pass migrations={{"
                f"{missing[0]}: fn, ...}})"
            )

    def upgrade(self, ref: str, meta: Mapping[str, Any], state: Any) -> Any:
        """``state`` (loaded from ``ref``) brought to the code's schema version, one migration
        per version; a migration that raises is reported with the step that failed."""
        self.check(ref, meta)
        if self.version is None:
            return state
        for step in range(self.saved_version(ref, meta), self.version):
            try:
                state = self.migrations[step](state)
            except Exception as e:
                raise SchemaMismatch(
                    f"migrating {ref} from schema version {step} to {step + 1} failed: "
                    f"{type(e).__name__}: {e}"
                ) from e
        return state
