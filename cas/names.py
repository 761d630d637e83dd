"""Validated names: ref names and the relative file paths a manifest may hold."""

from __future__ import annotations

import functools
import re
from typing import NewType

from cas.errors import InvalidName

RefName = NewType("RefName", str)
"""A validated ref name such as ``runs/20260115_143022_a1b2c3d4/phase2/ckpt_phase2_step00045000``."""

MAX_REF_LENGTH = 1024
MAX_SEGMENT_LENGTH = 255
_REF_SEGMENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._@+=,-]*\Z")
_PATH_FORBIDDEN = re.compile(r"[\x00-\x1f\\]")


def parse_ref_name(text: str) -> RefName:
    """Return ``text`` as a RefName or raise InvalidName saying what is wrong with it."""
    if not isinstance(text, str) or not text:
        raise InvalidName("ref name is empty")
    if "\x00" in text:
        raise InvalidName(f"ref name {text!r} contains a NUL byte")
    _refuse_url_or_path(text, "ref name")
    if len(text) > MAX_REF_LENGTH:
        raise InvalidName(f"ref name is longer than {MAX_REF_LENGTH} characters")
    for segment in text.split("/"):
        if segment == "":
            raise InvalidName(f"ref name {text!r} has an empty segment")
        if segment in (".", ".."):
            raise InvalidName(f"ref name {text!r} contains {segment!r}")
        if len(segment) > MAX_SEGMENT_LENGTH:
            raise InvalidName(f"ref name segment longer than {MAX_SEGMENT_LENGTH} characters")
        if not _REF_SEGMENT_RE.match(segment):
            raise InvalidName(
                f"ref name {text!r}: segment {segment!r} may use letters, digits and ._@+=,- "
                "and must start with a letter, digit or _"
            )
    return RefName(text)


def check_selector(text: str) -> str:
    """``text`` if it can select refs (a prefix, exact name or glob, or "" for all), else
    InvalidName: a URL or an absolute path selects nothing, and a listing that came back empty
    would not say why."""
    _refuse_url_or_path(text, "ref selector")
    return text


def _refuse_url_or_path(text: str, what: str) -> None:
    if "://" in text:
        raise InvalidName(
            f"{what} {text!r} is a URL: open the store at the URL (cas --store URL, "
            "cas.open(URL)) and name refs within it, like 'runs/r1/ckpt'"
        )
    if text.startswith("/"):
        raise InvalidName(f"{what} {text!r} is absolute; refs are relative like 'runs/r1/ckpt'")


def is_pattern(text: str) -> bool:
    """Whether a ref selector is a glob pattern rather than a name or prefix."""
    return any(c in text for c in "*?[")


def ref_matches(name: str, selector: str) -> bool:
    """Whether ``name`` is selected by ``selector``: a glob, an exact name, or a prefix.

    ``**`` in a glob crosses ``/``; a single ``*`` does not. A plain selector selects the ref of
    that name and every ref below it (``runs/r1`` selects ``runs/r1/phase1/ckpt``).
    """
    if is_pattern(selector):
        return glob_match(name, selector)
    prefix = selector.rstrip("/")
    return not prefix or name == prefix or name.startswith(prefix + "/")


def glob_match(name: str, pattern: str) -> bool:
    """Glob where ``*``, ``?`` and ``[...]`` stay within one '/' segment and ``**`` spans segments.

    ``**/`` also matches no folder at all (``**/best`` matches ``best``), as in git. ``[0-9]``,
    ``[!a]`` and ``[^a]`` are character classes; a ``[`` with no closing ``]`` is itself.
    """
    return _glob_regex(pattern).fullmatch(name) is not None


@functools.lru_cache(maxsize=1024)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` as a compiled regex, built once: a retention plan matches every ref against
    each rule's patterns, and building the regex character by character each time cost 6.9 us a
    match against 0.24 us with it built once (a checkpoint name against four policy patterns)."""
    regex = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            regex += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            regex += ".*"
            i += 2
        elif pattern[i] == "*":
            regex += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            regex += "[^/]"
            i += 1
        elif pattern[i] == "[" and (end := _class_end(pattern, i)) > 0:
            body = pattern[i + 1 : end]
            negate = body[:1] in ("!", "^")
            body = body[1:] if negate else body
            members = "".join("\\" + c if c in "\\^]" else c for c in body)
            regex += f"(?![/])[{'^' if negate else ''}{members}]"
            i = end + 1
        else:
            regex += re.escape(pattern[i])
            i += 1
    return re.compile(regex, flags=re.DOTALL)


def check_relative_path(text: str) -> str:
    """Validate a relative POSIX path stored in a manifest (no ``..``, absolute, NUL, empty)."""
    if not text or text.startswith("/") or _PATH_FORBIDDEN.search(text):
        raise InvalidName(f"unsafe path in manifest: {text!r}")
    for segment in text.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidName(f"unsafe path in manifest: {text!r}")
    return text


def _class_end(pattern: str, start: int) -> int:
    """Index of the ``]`` closing the class opened at ``start``, or -1 if there is none."""
    i = start + 1
    if pattern[i : i + 1] in ("!", "^"):
        i += 1
    if pattern[i : i + 1] == "]":
        i += 1  # a leading ']' is a member
    end = pattern.find("]", i)
    return end
