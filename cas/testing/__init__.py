"""Test support for cas: the blob-store conformance suite and a real S3 server for fixtures."""

import pytest

# Asserts in the shared suite get pytest's detailed failure messages only if rewritten on import.
pytest.register_assert_rewrite("cas.testing.conformance")

from cas.testing.conformance import (  # noqa: E402
    BlobStoreConformance,
    BlobStoreReadConformance,
    ManualClock,
    ReadOnlyConformance,
)
from cas.testing.seaweed import SeaweedServer, find_weed  # noqa: E402

__all__ = [
    "BlobStoreConformance",
    "BlobStoreReadConformance",
    "ManualClock",
    "ReadOnlyConformance",
    "SeaweedServer",
    "find_weed",
]
