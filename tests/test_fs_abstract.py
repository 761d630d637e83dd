"""fsspec's own abstract test suite (copy, get, put, pipe, open) run against ``cas://``.

Run the way s3fs runs it (``s3fs/tests/derived``): one fixtures class per store, and one empty
subclass per abstract suite, over a store on the local disk and over one in an S3 bucket (SeaweedFS,
from ``tests/conftest.py``); each test works in a directory of its own. No case is skipped: every
one applies (``supports_empty_directories`` holds; see docs/fs.md for how).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import fsspec.tests.abstract as abstract
import pytest
from fsspec.tests.abstract import AbstractFixtures

from cas.fs.filesystem import CASFileSystem


class LocalStoreFixtures(AbstractFixtures):  # type: ignore[misc]
    """``cas://`` over a store on the local disk: one store per class, one directory per test."""

    @pytest.fixture(scope="class")
    @classmethod
    def fs(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CASFileSystem]:
        store = tmp_path_factory.mktemp("abstract") / "store"
        fs = CASFileSystem(store=str(store), fsync=False, skip_instance_cache=True)
        yield fs
        fs.repo.close()

    @pytest.fixture
    def fs_path(self) -> str:
        return f"abstract/t{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def supports_empty_directories(self) -> bool:
        return True


class S3StoreFixtures(LocalStoreFixtures):
    """``cas://`` over a store in an S3 bucket (SeaweedFS), a fresh prefix per test."""

    pytestmark = [pytest.mark.s3, pytest.mark.slow]  # the S3 run takes one to two minutes

    @pytest.fixture
    def fs(self, s3_url: str) -> Iterator[CASFileSystem]:
        fs = CASFileSystem(store=s3_url, skip_instance_cache=True)
        yield fs
        fs.repo.close()


class TestLocalCopy(abstract.AbstractCopyTests, LocalStoreFixtures):  # type: ignore[misc]
    pass


class TestLocalGet(abstract.AbstractGetTests, LocalStoreFixtures):  # type: ignore[misc]
    pass


class TestLocalPut(abstract.AbstractPutTests, LocalStoreFixtures):  # type: ignore[misc]
    pass


class TestLocalPipe(abstract.AbstractPipeTests, LocalStoreFixtures):  # type: ignore[misc]
    pass


class TestLocalOpen(abstract.AbstractOpenTests, LocalStoreFixtures):  # type: ignore[misc]
    pass


class TestS3Copy(abstract.AbstractCopyTests, S3StoreFixtures):  # type: ignore[misc]
    pass


class TestS3Get(abstract.AbstractGetTests, S3StoreFixtures):  # type: ignore[misc]
    pass


class TestS3Put(abstract.AbstractPutTests, S3StoreFixtures):  # type: ignore[misc]
    pass


class TestS3Pipe(abstract.AbstractPipeTests, S3StoreFixtures):  # type: ignore[misc]
    pass


class TestS3Open(abstract.AbstractOpenTests, S3StoreFixtures):  # type: ignore[misc]
    pass
