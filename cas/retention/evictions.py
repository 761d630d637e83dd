"""Eviction logs: an append-only record, kept in the store, of every ref a retention rule removed.

A rule with ``eviction_log="pool"`` appends one record per evicted ref (its name, manifest, time,
reason and the manifest's metadata) to the append log under the ref ``logs/evictions/pool``
(``cas.refs.log``) before removing the ref, so what a pool model was rated outlives the model.
Appends move the log's ref by compare-and-swap, so concurrent writers never lose a record, and a
record already among the log's newest (same ref and manifest) is not written twice: rerunning a
forget that was killed between logging and removing adds nothing. Logs written before append
logs existed, as JSON lines under ``state/eviction-log/<name>/``, are read before the new ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from cas.errors import FormatError
from cas.refs.log import LOOKBACK, AppendLog, LogRecord, legacy_jsonl_names
from cas.refs.store import RefStore

LOG_REF_PREFIX = "logs/evictions/"
EVICTION_LOG_KIND = "eviction-log"
LOG_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")


def check_log_name(name: str) -> str:
    """Return ``name`` if it can name an eviction log, else raise FormatError."""
    if not LOG_NAME_RE.fullmatch(name):
        raise FormatError(f"bad eviction log name {name!r}: use letters, digits and ._-")
    return name


def log_ref(name: str) -> str:
    """The ref an eviction log is kept under."""
    return LOG_REF_PREFIX + check_log_name(name)


def _log(refs: RefStore, name: str) -> AppendLog:
    return AppendLog(refs, log_ref(name), EVICTION_LOG_KIND, legacy_jsonl=name)


def _identity(record: LogRecord) -> tuple[Any, Any]:
    return record.get("ref"), record.get("manifest")


def append_evictions(refs: RefStore, name: str, records: Iterable[Mapping[str, Any]]) -> int:
    """Append records to the log ``name``; return how many were new."""
    pending = [dict(r) for r in records]
    if not pending:
        return 0
    log = _log(refs, name)
    appended = log.append(pending, op="evict", unique=_identity, lookback=LOOKBACK + len(pending))
    return appended.added


def read_evictions(refs: RefStore, name: str) -> list[dict[str, Any]]:
    """Every record of the log, oldest first, in append order."""
    return [dict(r) for r in _log(refs, name).records() if isinstance(r, dict)]


def eviction_logs(refs: RefStore) -> list[str]:
    """Names of the logs in the store."""
    names = {name[len(LOG_REF_PREFIX) :] for name in refs.names(LOG_REF_PREFIX)}
    return sorted(names | legacy_jsonl_names(refs))
