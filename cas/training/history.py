"""Training history: the append-only log of per-step records of one run, kept across restarts.

The loss history is never archived or reset, across restarts, resumes and policy changes. It is
an append log (``cas.refs.log``) of kind ``training-history`` under one ref
(``runs/<id>/history`` by default). A record is a plain msgpack map, ``{"step": int, ...}`` with
numbers, strings, bools, None, lists and maps as values, so reading a history needs no torch:
this module does not import it. Appends move the ref by compare-and-swap, so two writers never
lose each other's records, and cost O(new records): old records sit in sealed segments every
later version shares. Histories written before append logs (msgpack inside byte tensors) are
read as they are and rewritten in the log layout by the next append.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cas.errors import FormatError

if TYPE_CHECKING:
    from cas.repo.repository import Repository

HISTORY_KIND = "training-history"

HistoryRecord = dict[str, Any]
"""One entry of a training history: ``{"step": int, **values}``, plain values only."""


def plain_record(step: int, values: Mapping[str, Any], *, what: str = "history") -> HistoryRecord:
    """A record ``{"step": step, **values}`` with tensor and numpy scalars turned into numbers;
    ``what`` names the values in errors."""
    record: HistoryRecord = {"step": int(step)}
    for key, value in values.items():
        if not isinstance(key, str):
            raise FormatError(f"{what} keys must be strings, got {key!r}")
        record[key] = _plain(value, key, what)
    return record


def _plain(value: Any, where: str, what: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where, what) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}", what) for k, v in value.items()}
    scalar = _scalar(value)
    if scalar is not None:
        return scalar
    raise FormatError(
        f"{what} value {where!r} is a {type(value).__name__}: use numbers, strings, bools, "
        "None, lists and dicts"
    )


def _scalar(value: Any) -> bool | int | float | None:
    """The number inside a one-element tensor or a numpy scalar, found by duck typing so this
    module never imports torch or numpy."""
    item, numel = getattr(value, "item", None), getattr(value, "numel", None)
    size = numel() if callable(numel) else getattr(value, "size", None)
    if callable(item) and size == 1:
        number = item()
        if isinstance(number, (bool, int, float)):
            return number
    return None


class TrainingHistory:
    """The append-only record log of one run, stored under ``ref``."""

    def __init__(self, repo: Repository, ref: str) -> None:
        self.repo = repo
        self.ref = ref
        self._log = repo.append_log(ref, HISTORY_KIND)

    def __len__(self) -> int:
        return len(self._log)

    def append(self, records: Sequence[HistoryRecord]) -> int:
        """Append ``records`` (plain dicts) by compare-and-swap; return the new record count."""
        for record in records:
            if not isinstance(record, dict):
                raise FormatError(f"a history record is a dict, not {type(record).__name__}")
        if not records:
            return len(self)
        return self._log.append(records, op="history").total

    def read(self) -> list[HistoryRecord]:
        """Every record, oldest first."""
        return self._log.records()
