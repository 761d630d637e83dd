"""Listing refs when some are damaged: every readable record, and what could not be read.

A listing (``cas ls``, ``du``, ``stats``, ``verify``) must not let one damaged ref hide the rest:
it shows every ref it can read and names each one it cannot, with the reason. What to do about a
damaged ref (warn, or fail) is the caller's choice; GC, which could delete what a damaged ref
protects, keeps what it may reach (``cas.retention.damage``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cas.refs.records import RefRecord
from cas.refs.store import RefStore


@dataclass(frozen=True)
class DamagedRef:
    """A ref (or a ref blob whose name cannot be read: its key) a listing could not use."""

    ref: str
    error: str

    def __str__(self) -> str:
        return f"{self.ref}: {self.error}"

    def to_dict(self) -> dict[str, str]:
        """Plain data for ``--json``."""
        return {"ref": self.ref, "error": self.error}


@dataclass(frozen=True)
class RefListing:
    """The refs a selector picks: the readable records, sorted by name, and the damaged ones."""

    records: tuple[RefRecord, ...]
    damaged: tuple[DamagedRef, ...]


def list_refs(refs: RefStore, selector: str = "") -> RefListing:
    """Every ref ``selector`` (prefix, exact name or glob) picks, read without stopping at a
    damaged one."""
    records: list[RefRecord] = []
    damaged: list[DamagedRef] = []
    for scanned in refs.scan(selector):
        if scanned.record is not None:
            records.append(scanned.record)
        else:
            damaged.append(DamagedRef(scanned.label, str(scanned.error)))
    return RefListing(tuple(records), tuple(damaged))
