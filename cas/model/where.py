"""Filters over checkpoint metadata (``cas ls --where 'step>=1000'``): parsed, never evaluated.

A condition is ``KEY OP VALUE`` with OP one of ``>= <= > < == != =`` (``=`` is ``==``). KEY may
be dotted to reach into nested metadata (``eval.loss<2``). VALUE is read as JSON when it is
JSON (``1000``, ``0.5``, ``true``, ``"text"``) and as plain text otherwise. Numbers compare as
numbers, text with text; a value of another type matches no ordering condition, and a
checkpoint without the key matches only ``!=``.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cas.errors import InvalidName

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
    "=": operator.eq,
}
_CONDITION = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.\-]*)\s*(>=|<=|==|!=|>|<|=)\s*(.*?)\s*\Z")
_MISSING = object()


@dataclass(frozen=True)
class MetaCondition:
    """One parsed ``KEY OP VALUE`` condition."""

    key: str
    op: str
    value: Any

    @classmethod
    def parse(cls, text: str) -> MetaCondition:
        """Parse ``step>=1000``; InvalidName (a ValueError) says what a condition looks like."""
        found = _CONDITION.match(text)
        if found is None or not found.group(3) or found.group(3)[0] in "<>=!":
            raise InvalidName(
                f"bad condition {text!r}: use KEY OP VALUE with OP one of >= <= > < == != "
                "(e.g. 'step>=1000', 'tag==eval')"
            )
        key, op, raw = found.groups()
        try:
            value = json.loads(raw, parse_constant=str)
        except ValueError:
            value = raw
        return cls(key, op, value)

    def matches(self, meta: Mapping[str, Any]) -> bool:
        """Whether metadata ``meta`` satisfies the condition."""
        actual = _lookup(meta, self.key)
        if actual is _MISSING:
            return self.op == "!="
        compare = _OPS[self.op]
        if _is_number(actual) and _is_number(self.value):
            return compare(actual, self.value)
        if isinstance(actual, str) and isinstance(self.value, str):
            return compare(actual, self.value)
        if self.op in ("==", "=", "!="):
            # ``name==3`` on the text "3" matches, as a person reading the listing expects.
            return compare(_text(actual), _text(self.value))
        return False


def parse_conditions(texts: list[str] | tuple[str, ...]) -> list[MetaCondition]:
    """Parse several conditions (all must hold)."""
    return [MetaCondition.parse(text) for text in texts]


def matches_all(conditions: list[MetaCondition], meta: Mapping[str, Any]) -> bool:
    """Whether ``meta`` satisfies every condition."""
    return all(condition.matches(meta) for condition in conditions)


def _lookup(meta: Mapping[str, Any], key: str) -> Any:
    if key in meta:  # a key with dots of its own wins over a nested path
        return meta[key]
    node: Any = meta
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
