"""Where a ref is stored: one blob key per ref name, short enough for every backend.

A ref's key is ``refs/`` and its name URL-quoted with no safe characters (``/`` -> ``%2F``), in
one flat directory so that no name shadows another. A quoted name can reach three times the
1,024 characters a name may have, but a local file name holds 255 bytes and an S3 key 1,024 with
the prefix, so a name whose quoted form is longer than ``MAX_PLAIN_NAME`` is stored under its
quoted head, ``~`` and the blake3 of the name instead; its record holds the full name. ``~`` is
not a ref-name character and quoting leaves it as it is, so the two shapes never meet, and every
name that fits keeps the key it always had.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from cas.digest import digest_of
from cas.errors import CASError
from cas.names import RefName, parse_ref_name

REFS_PREFIX = "refs/"
MAX_PLAIN_NAME = 255
"""Quoted names up to this many bytes are keys as they are: the longest file name a local disk
takes, and so every name an older cas could store there."""
HASHED_HEAD = 160
"""Bytes of the quoted name a hashed key keeps in front, so prefix listings still narrow it."""
HASH_MARK = "~"
MAX_KEY_NAME = HASHED_HEAD + len(HASH_MARK) + 64
"""The longest key segment a ref ever needs (a hashed key's): 225 bytes."""


def _quoted(name: str) -> str:
    return quote(name, safe="")


def ref_key(name: RefName) -> str:
    """The blob key of a ref: its quoted name, or quoted head + ``~`` + hash when that is long."""
    quoted = _quoted(name)
    if len(quoted) <= MAX_PLAIN_NAME:
        return REFS_PREFIX + quoted
    head = quoted[:HASHED_HEAD]
    cut = head.rfind("%", len(head) - 2)
    if cut >= 0:
        head = head[:cut]  # never end inside a %XX escape: the head stays a quoted prefix
    return REFS_PREFIX + head + HASH_MARK + digest_of(name.encode())


MAX_LEGACY_KEY = 1024
"""No backend ever took a longer key (S3's limit), so a longer legacy key is never looked up."""


def legacy_key(name: RefName) -> str | None:
    """Where an older cas stored a long name (the whole quoted name, which only object stores
    took), or None when the name's key never changed or no store could have held it."""
    key = REFS_PREFIX + _quoted(name)
    return key if key != ref_key(name) and len(key) <= MAX_LEGACY_KEY else None


def listing_prefix(literal: str) -> str:
    """A key prefix under which every ref whose name starts with ``literal`` is stored."""
    return REFS_PREFIX + _quoted(literal)[: HASHED_HEAD - 2]


def is_hashed_key(key: str) -> bool:
    """Whether ``key`` is a long name's hashed key, whose name only its record holds."""
    return HASH_MARK in key[len(REFS_PREFIX) :]


def name_in_key(key: str) -> RefName:
    """The ref name a plain key spells; InvalidName when it spells none (hashed keys included)."""
    return parse_ref_name(unquote(key[len(REFS_PREFIX) :]))


def plain_name_in_key(key: str) -> RefName | None:
    """The ref name a plain (not hashed) key spells, or None if it spells none."""
    try:
        return name_in_key(key)
    except CASError:
        return None
