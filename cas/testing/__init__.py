"""Test support for cas: the blob-store conformance suite and a real S3 server for fixtures."""

import pytest

# Asserts in the shared suite get pytest's detailed failure messages only if rewritten on import.
pytest.register_assert_rewrite("cas.testing.conformance")

from cas.testing.conformance import BlobStoreConformance, ManualClock  # noqa: E402
from cas.testing.seaweed import SeaweedServer, find_weed  # noqa: E402

__all__ = ["BlobStoreConformance", "ManualClock", "SeaweedServer", "find_weed"]
