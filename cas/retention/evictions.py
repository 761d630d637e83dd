"""Eviction logs: an append-only record, kept in the store, of every ref a retention rule removed.

Hydra appends a pool model's rating history to a log before deleting it; here a rule with
``eviction_log="pool"`` appends one JSON line per evicted ref (its name, manifest, time, reason
and the manifest's metadata) to ``state/eviction-log/pool/<YYYY-MM>.jsonl`` before removing it.
Appends are compare-and-swap updates of the month's segment, so concurrent writers never lose a
line, and a record already in the segment (same ref and manifest) is not written twice: rerunning
a forget that was killed between logging and removing adds nothing.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from cas.errors import FormatError, NotFound, PreconditionFailed

if TYPE_CHECKING:
    from cas.repo.repository import Repository

LOG_PREFIX = "state/eviction-log/"
LOG_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
CAS_RETRIES = 32


def check_log_name(name: str) -> str:
    """Return ``name`` if it can name an eviction log, else raise FormatError."""
    if not LOG_NAME_RE.fullmatch(name):
        raise FormatError(f"bad eviction log name {name!r}: use letters, digits and ._-")
    return name


def _segment_key(name: str, when: float) -> str:
    return f"{LOG_PREFIX}{check_log_name(name)}/{time.strftime('%Y-%m', time.gmtime(when))}.jsonl"


def _identity(record: Mapping[str, Any]) -> tuple[Any, Any]:
    return record.get("ref"), record.get("manifest")


def append_evictions(
    repo: Repository, name: str, records: Iterable[Mapping[str, Any]], when: float
) -> int:
    """Append records to the log's segment for ``when``; return how many were new."""
    pending = list(records)
    if not pending:
        return 0
    key = _segment_key(name, when)
    for _ in range(CAS_RETRIES):
        try:
            data, version = repo.blobs.get_versioned(key)
        except NotFound:
            data, version = b"", None
        present = {_identity(r) for r in _parse_lines(data, key)}
        new = [r for r in pending if _identity(r) not in present]
        if not new:
            return 0
        lines = b"".join(json.dumps(dict(r), sort_keys=True).encode() + b"\n" for r in new)
        try:
            repo.blobs.put_conditional(key, data + lines, version)
        except PreconditionFailed:
            continue
        return len(new)
    raise PreconditionFailed(
        f"eviction log {key!r} kept changing; {len(pending)} records not written"
    )


def read_evictions(repo: Repository, name: str) -> list[dict[str, Any]]:
    """Every record of the log, oldest segment first, in append order."""
    prefix = f"{LOG_PREFIX}{check_log_name(name)}/"
    records: list[dict[str, Any]] = []
    for key in sorted(repo.blobs.list(prefix)):
        try:
            records.extend(_parse_lines(repo.blobs.get(key), key))
        except NotFound:
            continue
    return records


def eviction_logs(repo: Repository) -> list[str]:
    """Names of the logs in the store."""
    return sorted({key[len(LOG_PREFIX) :].split("/", 1)[0] for key in repo.blobs.list(LOG_PREFIX)})


def _parse_lines(data: bytes, key: str) -> list[dict[str, Any]]:
    out = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise FormatError(f"eviction log {key!r} line {number} is not JSON: {e}") from e
        if isinstance(record, dict):
            out.append(record)
    return out
