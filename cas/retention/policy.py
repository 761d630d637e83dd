"""Retention policies: rules over ref names that decide which refs to keep, planned as a ForgetPlan.

A ``RetentionPolicy`` holds ``Rule``s; each governs the refs its ``select`` pattern matches (the
first matching rule wins; refs no rule selects are always kept) and splits them into groups
(``group_by``: the parent prefix by default, N leading segments, or a regex's first group).
Within a group, newest first:

- *protected* (never removed, not even by the size budget): the group's latest, ``protect``
  patterns, refs naming the same manifest as a ref matching ``protect_targets_of`` (a ``best``
  pointer, ``runs/*/gates/*``), the ``keep_best`` refs by a metric read from ``meta["metrics"][name]``
  or ``meta[name]``, anything younger than ``min_age``/``protect_within``, and the newest ref of
  each of the last ``protect_days`` calendar days (today, yesterday...).
- *kept* by ``keep_last``, ``keep_within``, ``keep_hourly/daily/weekly/monthly`` (restic's
  meaning: the newest ref of each of the last N hours/days/... that have one). A rule with none
  of these keeps everything the other limits allow.
- ``max_count`` then removes the oldest unprotected refs until the group has at most that many
  (protected refs count towards it, so a FIFO of 20 holds 20 refs, gates included).

Finally ``max_total_bytes`` (the store-wide budget) removes kept, unprotected refs, lowest
``budget_priority`` first and oldest first within it, until what the remaining refs reach fits.
Bytes are stored bytes of chunks and manifests; a ref only frees what no kept ref shares.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import zoneinfo
from dataclasses import dataclass, fields, replace
from typing import Any

from cas.errors import FormatError
from cas.names import ref_matches
from cas.units import format_duration, format_size, parse_duration, parse_size

PERIODS: tuple[tuple[str, str], ...] = (
    ("keep_hourly", "hourly"),
    ("keep_daily", "daily"),
    ("keep_weekly", "weekly"),
    ("keep_monthly", "monthly"),
)
"""The calendar keep-* limits, and the word for their buckets."""
RETENTION_SECTION = "retention"
"""The ``StoreConfig.extra`` section holding the stored policy."""
_DURATION_FIELDS = ("keep_within", "protect_within", "min_age")


@dataclass(frozen=True)
class Best:
    """Keep the ``count`` best refs by ``metric``; ``mode`` is ``min`` (a loss) or ``max``."""

    metric: str
    mode: str = "min"
    count: int = 1

    def __post_init__(self) -> None:
        if not self.metric or self.mode not in ("min", "max") or self.count < 1:
            raise ValueError(f"bad keep-best {self.metric}:{self.mode}:{self.count}")

    @classmethod
    def parse(cls, text: str) -> Best:
        """``eval_loss``, ``eval_loss:min``, ``rating:max:2``."""
        parts = text.split(":")
        if not 1 <= len(parts) <= 3 or not parts[0]:
            raise ValueError(f"bad keep-best {text!r}: use METRIC[:min|max[:COUNT]]")
        return cls(
            parts[0], parts[1] if len(parts) > 1 else "min", int(parts[2]) if len(parts) > 2 else 1
        )

    def value(self, meta: dict[str, Any]) -> float | None:
        """The metric from ``meta["metrics"][metric]``, else ``meta[metric]``; None if absent."""
        metrics = meta.get("metrics")
        raw = metrics.get(self.metric) if isinstance(metrics, dict) else None
        if raw is None:
            raw = meta.get(self.metric)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
            return None
        return float(raw)

    def __str__(self) -> str:
        return f"{self.metric}:{self.mode}:{self.count}"


@dataclass(frozen=True)
class Rule:
    """How to retain the refs ``select`` matches (a glob like ``runs/*/phase*/ckpt_*`` or a prefix)."""

    select: str
    name: str = ""
    group_by: int | str | None = None
    time: str = "created"
    """``created``: the manifest's creation time; ``ref``: when the ref last changed (copies)."""
    keep_last: int = 0
    keep_within: float = 0.0
    keep_hourly: int = 0
    keep_daily: int = 0
    keep_weekly: int = 0
    keep_monthly: int = 0
    keep_best: tuple[Best, ...] = ()
    max_count: int = 0
    keep_latest: bool = True
    protect: tuple[str, ...] = ()
    protect_targets_of: tuple[str, ...] = ()
    protect_within: float = 0.0
    protect_days: int = 0
    budget_priority: int = 0
    eviction_log: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.select, str) or not self.select:
            raise ValueError("a rule needs a select pattern (a string)")
        if self.time not in ("created", "ref"):
            raise ValueError(f"rule time must be 'created' or 'ref', not {self.time!r}")
        counts = ("keep_last", "keep_hourly", "keep_daily", "keep_weekly", "keep_monthly")
        for name in (*counts, "max_count", "protect_days", "budget_priority"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be a whole number, not {value!r}")
            if value < 0 and name != "budget_priority":
                raise ValueError(f"{name} must not be negative")
        for name in ("keep_within", "protect_within"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"{name} must be a duration of 0 seconds or more, not {value!r}")
            if value == float("inf"):
                raise ValueError(f"{name} must be finite")
        if isinstance(self.group_by, str):
            try:
                re.compile(self.group_by)
            except re.error as e:
                raise ValueError(f"bad group_by regex {self.group_by!r}: {e}") from e
        elif isinstance(self.group_by, int) and self.group_by < 0:
            raise ValueError("group_by depth must not be negative")
        if self.eviction_log:
            from cas.retention.evictions import check_log_name

            check_log_name(self.eviction_log)

    @property
    def label(self) -> str:
        """The rule's name, else its pattern."""
        return self.name or self.select

    @property
    def has_keep_limits(self) -> bool:
        """Whether some keep-* limit decides what is kept (else everything is, before max_count)."""
        return bool(self.keep_last or self.keep_within or any(getattr(self, f) for f, _ in PERIODS))

    def keep_limits(self) -> list[str]:
        """The keep-* limits, as words for a drop reason."""
        out = []
        if self.keep_last:
            out.append(f"keep-last {self.keep_last}")
        if self.keep_within:
            out.append(f"keep-within {format_duration(self.keep_within)}")
        out.extend(f"keep-{word} {getattr(self, f)}" for f, word in PERIODS if getattr(self, f))
        return out

    def group_of(self, ref: str) -> str:
        """The group key of a ref this rule selects."""
        parent = ref.rpartition("/")[0]
        if self.group_by is None:
            return parent
        if isinstance(self.group_by, int):
            return "/".join(ref.split("/")[: self.group_by])
        match = re.match(self.group_by, ref)
        if match is None:
            return parent
        return match.group(1) if match.groups() else match.group(0)

    def to_dict(self) -> dict[str, Any]:
        """Plain data with only the fields that differ from the defaults."""
        out: dict[str, Any] = {}
        defaults = Rule("x")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "select" or value != getattr(defaults, f.name):
                out[f.name] = [str(b) for b in value] if f.name == "keep_best" else value
        for name in ("protect", "protect_targets_of"):
            if name in out:
                out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Rule:
        """Parse a rule; durations may be strings (``"36h"``), unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(doc) - known
        if unknown:
            raise FormatError(f"unknown retention rule settings: {', '.join(sorted(unknown))}")
        values = dict(doc)
        for name in _DURATION_FIELDS:
            if name in values:
                values[name] = parse_duration(values[name])
        if "keep_best" in values:
            values["keep_best"] = tuple(
                b if isinstance(b, Best) else Best.parse(b) if isinstance(b, str) else Best(**b)
                for b in values["keep_best"]
            )
        for name in ("protect", "protect_targets_of"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)


@dataclass(frozen=True)
class DailySnapshot:
    """Once a day, a weights-only copy of the newest checkpoint ``source`` selects.

    ``Repository.take_snapshots`` (run by ``forget`` before it plans) copies the newest ref
    matching ``source`` (by manifest creation time) to ``into`` with ``{date}`` as today's
    ``YYYY-MM-DD`` in the policy's timezone, keeping the entries ``only`` matches, unless that
    ref exists. A copy writes no chunk. The snapshots are then retained by a rule of their own,
    ahead of the policy's rules: the last ``keep`` of them (0: all), the newest of each of the
    last ``protect_days`` days protected even from the budget.
    """

    source: str
    into: str = "snapshots/{date}"
    only: tuple[str, ...] = ("model.*",)
    keep: int = 7
    protect_days: int = 0
    budget_priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("a daily snapshot needs a source pattern")
        if self.into.count("{date}") != 1 or "{" in self.into.replace("{date}", ""):
            raise ValueError(
                f"snapshot name {self.into!r} must hold {{date}} once, and no other {{}}"
            )
        if not self.only or not all(isinstance(p, str) and p for p in self.only):
            raise ValueError("a daily snapshot needs the key patterns it keeps (only)")
        for name in ("keep", "protect_days", "budget_priority"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"snapshot {name} must be a whole number, not {value!r}")
        if self.keep < 0 or self.protect_days < 0:
            raise ValueError("snapshot keep and protect_days must not be negative")

    def ref_for(self, day: dt.date) -> str:
        """The snapshot ref of ``day``."""
        return self.into.replace("{date}", day.isoformat())

    def rule(self) -> Rule:
        """The rule that retains these snapshots."""
        return Rule(
            self.into.replace("{date}", "*"),
            name=f"daily snapshots of {self.source}",
            keep_last=self.keep,
            protect_days=self.protect_days,
            budget_priority=self.budget_priority,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the stored policy."""
        return {
            "source": self.source,
            "into": self.into,
            "only": list(self.only),
            "keep": self.keep,
            "protect_days": self.protect_days,
            "budget_priority": self.budget_priority,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> DailySnapshot:
        """Parse one snapshot setting; unknown keys are an error."""
        unknown = set(doc) - {f.name for f in fields(cls)}
        if unknown:
            raise FormatError(f"unknown daily snapshot settings: {', '.join(sorted(unknown))}")
        values = dict(doc)
        if "only" in values:
            only = values["only"]
            values["only"] = (only,) if isinstance(only, str) else tuple(only)
        return cls(**values)

    def describe(self) -> str:
        """One line for ``cas policy show``."""
        keep = f"keep last {self.keep}" if self.keep else "keep all"
        days = f", protect {self.protect_days} days" if self.protect_days else ""
        return f"daily snapshot {self.into} <- newest {self.source} ({', '.join(self.only)}), {keep}{days}"


@dataclass(frozen=True)
class RetentionPolicy:
    """Rules plus store-wide settings. ``Repository.plan_forget(policy)`` says what it would
    remove (``cas.retention.plan``), ``Repository.forget(policy)`` removes it."""

    rules: tuple[Rule, ...] = ()
    protect: tuple[str, ...] = ()
    """Refs matching these are never removed, whatever rule selects them."""
    min_age: float = 0.0
    """Refs younger than this are never removed (a safety buffer for in-progress work)."""
    max_total_bytes: int = 0
    """Store-wide budget on what kept refs reach; 0 means none."""
    timezone: str = "UTC"
    """Where calendar hours/days/weeks/months begin: ``UTC``, ``local`` or an IANA name."""
    snapshots: tuple[DailySnapshot, ...] = ()
    """Daily weights-only snapshots ``forget`` takes before it plans, each retained by a rule
    ahead of ``rules``."""

    def __post_init__(self) -> None:
        if self.min_age < 0 or self.max_total_bytes < 0:
            raise ValueError("min_age and max_total_bytes must not be negative")
        zone_of(self.timezone)

    def effective_rules(self) -> tuple[Rule, ...]:
        """The rules a plan applies: each daily snapshot's rule first, then ``rules``."""
        return (*(snap.rule() for snap in self.snapshots), *self.rules)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``StoreConfig.extra["retention"]`` and ``--json``."""
        return {
            "rules": [rule.to_dict() for rule in self.rules],
            "protect": list(self.protect),
            "min_age": self.min_age,
            "max_total_bytes": self.max_total_bytes,
            "timezone": self.timezone,
            **(
                {"snapshots": [snap.to_dict() for snap in self.snapshots]} if self.snapshots else {}
            ),
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RetentionPolicy:
        """Parse a policy (sizes may be ``"150G"``, durations ``"1h"``)."""
        if not isinstance(doc, dict):
            raise FormatError("a retention policy must be a map")
        unknown = set(doc) - {f.name for f in fields(cls)}
        if unknown:
            raise FormatError(f"unknown retention policy settings: {', '.join(sorted(unknown))}")
        try:
            return cls(
                rules=tuple(Rule.from_dict(r) for r in doc.get("rules", ())),
                protect=tuple(doc.get("protect", ())),
                min_age=parse_duration(doc.get("min_age", 0)),
                max_total_bytes=parse_size(doc.get("max_total_bytes", 0)),
                timezone=str(doc.get("timezone", "UTC")),
                snapshots=tuple(DailySnapshot.from_dict(d) for d in doc.get("snapshots", ())),
            )
        except (TypeError, ValueError) as e:
            raise FormatError(f"bad retention policy: {e}") from e

    @classmethod
    def from_config(cls, extra: dict[str, Any]) -> RetentionPolicy | None:
        """The policy stored in ``StoreConfig.extra``, or None."""
        doc = extra.get(RETENTION_SECTION)
        return None if not doc else cls.from_dict(doc)

    def describe(self) -> list[str]:
        """Human-readable lines."""
        lines = []
        for rule in self.rules:
            parts = [f"{k}={_show(k, v)}" for k, v in rule.to_dict().items() if k != "select"]
            lines.append(f"rule {rule.select}: {', '.join(parts) or 'keep everything'}")
        if self.protect:
            lines.append(f"protect: {', '.join(self.protect)}")
        if self.min_age:
            lines.append(f"min-age: {format_duration(self.min_age)}")
        if self.max_total_bytes:
            lines.append(f"max-total: {format_size(self.max_total_bytes)}")
        if self.timezone != "UTC":
            lines.append(f"timezone: {self.timezone}")
        lines.extend(snap.describe() for snap in self.snapshots)
        return lines or ["no retention policy: forget removes nothing"]


def _show(key: str, value: Any) -> str:
    if key in _DURATION_FIELDS:
        return format_duration(value)
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def rule_from_options(select: str, **options: Any) -> Rule:
    """A Rule from CLI-style options (None means unset), parsing durations and keep-best."""
    values = {k: v for k, v in options.items() if v not in (None, (), "")}
    return Rule.from_dict({"select": select, **values})


def policy_with(policy: RetentionPolicy, **changes: Any) -> RetentionPolicy:
    """A copy with store-wide settings changed (None leaves one as it is)."""
    return replace(policy, **{k: v for k, v in changes.items() if v is not None})


PRECIOUS_REFS: tuple[tuple[str, str], ...] = (
    ("gates/**", "a gate"),
    ("**/gates/**", "a gate"),
    ("**/best", "a best pointer"),
)
"""Refs no writer replaces without being told to, whatever policy the store holds."""


def protection_of(name: str, policy: RetentionPolicy | None) -> str | None:
    """Why replacing the ref ``name`` needs an explicit overwrite (None: it does not).

    Gates and ``best`` pointers always do; so does any ref the stored policy protects by name
    (its ``protect`` patterns and its rules' ``protect`` patterns). A pointer a rule's
    ``protect_targets_of`` names (a ``latest``) does not: the policy protects what it points
    at, and moving it at every save is what it is for.
    """
    for pattern, what in PRECIOUS_REFS:
        if ref_matches(name, pattern):
            return what
    if policy is None:
        return None
    if any(ref_matches(name, p) for rule in policy.rules for p in rule.protect_targets_of):
        return None
    patterns = [*policy.protect]
    for rule in policy.rules:
        patterns.extend(rule.protect)
    for pattern in patterns:
        if ref_matches(name, pattern):
            return f"protected by the store's retention policy ({pattern})"
    return None


def zone_of(name: str) -> dt.tzinfo | None:
    """The time zone calendar buckets use: ``UTC``, ``local`` (None) or an IANA name."""
    if name == "UTC":
        return dt.timezone.utc
    if name == "local":
        return None
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as e:
        raise ValueError(f"unknown timezone {name!r}") from e
