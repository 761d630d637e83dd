"""Naming the tensors of a scanned pickle by their dotted paths in the saved object."""

from __future__ import annotations

from collections.abc import Iterator

from cas.formats._pickle_allow import DTYPE_ITEMSIZE
from cas.formats._pickle_scan import TensorRef, _Global

MAX_NAME_DEPTH = 256
"""Deepest container whose tensors are named by path; deeper ones keep storage names."""


def named_tensors(root: object) -> Iterator[tuple[str, TensorRef]]:
    """Tensors reachable from ``root`` with their dotted paths, depth-first in insertion order.

    The same tensor reached twice is yielded twice; a container reached twice is walked once.
    Paths through keys that have no plain text form (or deeper than ``MAX_NAME_DEPTH``) are "".
    """
    stack: list[tuple[tuple[str, ...] | None, object]] = [((), root)]
    seen: set[int] = set()
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, TensorRef):
            yield ("" if path is None else ".".join(path)), obj
            continue
        if id(obj) in seen or not isinstance(obj, (dict, list, tuple)):
            continue
        seen.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        children: list[tuple[tuple[str, ...] | None, object]] = []
        for key, value in items:
            text = _key_text(key)
            if path is None or text is None or len(path) >= MAX_NAME_DEPTH:
                children.append((None, value))
            else:
                children.append(((*path, text), value))
        stack.extend(reversed(children))


def _key_text(key: object) -> str | None:
    """``str(key)`` for keys whose text is cheap and unambiguous (as a path component)."""
    if key is None or isinstance(key, (str, bytes, bool, float)):
        return str(key)
    if isinstance(key, int):
        return str(key) if key.bit_length() <= 64 else None
    if isinstance(key, tuple) and len(key) <= 16 and all(_is_plain_key(k) for k in key):
        return str(key)
    if isinstance(key, _Global) and key.name.removeprefix("torch.") in DTYPE_ITEMSIZE:
        return key.name  # a dtype key prints as torch.float32
    return None


def _is_plain_key(key: object) -> bool:
    """A constant whose ``str`` is its text (no tuple, no allowed global)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key.bit_length() <= 64
    return key is None or isinstance(key, (str, bytes, bool, float))
