"""Human units for retention and GC settings: durations (``36h``, ``7d``, ``1h30m``) and sizes (``150G``)."""

from __future__ import annotations

import math
import re

_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhdw])")
_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?b?)", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``text``: a number of seconds, or unit terms like ``36h``, ``7d``, ``1h30m``, ``90m``.

    Units: s, m (minutes), h, d, w. A bare number is seconds. Raises ValueError on anything else.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        cleaned = str(text).strip().lower().replace(" ", "")
        if not cleaned:
            raise ValueError("empty duration")
        try:
            seconds = float(cleaned)
        except ValueError:
            pos, seconds = 0, 0.0
            for match in _DURATION_RE.finditer(cleaned):
                if match.start() != pos:
                    break
                seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
                pos = match.end()
            if pos != len(cleaned):
                raise ValueError(
                    f"bad duration {text!r}: use a number with a unit, like 90m, 36h, 7d or 1h30m"
                ) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"bad duration {text!r}: must be a finite, non-negative time")
    return seconds


def format_duration(seconds: float) -> str:
    """``129600`` -> ``'36h'``, ``5400`` -> ``'1h30m'``, ``0.25`` -> ``'0.25s'``."""
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:g}s"
    remaining = round(seconds)
    if remaining == 0:
        return "0s"
    parts = []
    # Days only when whole, so 36h stays "36h" the way people write it.
    units = (("d", 86400),) if remaining % 86400 == 0 else ()
    for unit, size in (*units, ("h", 3600), ("m", 60), ("s", 1)):
        count, remaining = divmod(remaining, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: ``150G``, ``1.5TiB``, ``512M``, ``4096``.

    K, M, G, T, P are powers of 1024 with or without ``B``/``iB`` (as ``du -h`` prints them).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"bad size {text!r}: must not be negative")
        return text
    match = _SIZE_RE.fullmatch(str(text).strip())
    suffix = match.group(3).lower() if match else ""
    if match is None or suffix == "i" or (suffix == "ib" and not match.group(2)):
        raise ValueError(f"bad size {text!r}: use a number with an optional unit, like 150G")
    return int(float(match.group(1)) * 1024 ** _SIZE_POWERS[match.group(2).lower()])


def format_size(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'`` (the CLI's ``human_bytes``; here so lower layers can print)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
