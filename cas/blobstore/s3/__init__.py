"""S3: blobs as objects under ``s3://bucket/prefix/`` on AWS S3 or an S3-compatible server.

``store`` is the ``S3BlobStore``; ``client`` its settings and botocore clients; ``transfer`` the
managed (parallel) uploads and downloads; ``probe`` what the server's conditional writes are
found to enforce; ``errors`` the translation of S3 answers into the cas error tree.
"""

from cas.blobstore.s3.client import S3Options
from cas.blobstore.s3.probe import PROBE_DIR
from cas.blobstore.s3.store import S3BlobStore

__all__ = ["PROBE_DIR", "S3BlobStore", "S3Options"]
