"""A training node's S3 credential that writes but cannot delete, on a real SeaweedFS.

SeaweedFS identities (``weed s3 -config``) name coarse actions, and its ``Write`` covers
``DeleteObject``: no identity alone can write without deleting. A bucket policy denying
``s3:DeleteObject`` to the writer's principal can (docs/s3.md): saves and ref moves work, the
checkpoint data cannot be deleted with that credential, and the maintenance credential runs GC.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

import cas
from cas.retention.gc import GCSettings
from cas.retention.policy import RetentionPolicy, Rule
from cas.testing.seaweed import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, REGION, SeaweedServer
from tests.prerequisites import require_weed

BUCKET = "checkpoints"
PREFIX = "team-a"
PROTECTED = ("chunks", "manifests", "refs", "keys", "quarantine")
"""What the writer may not delete: the data and what names it (leases and the clock probe it may)."""


def identity(name: str, access: str, secret: str, actions: list[str]) -> dict[str, object]:
    return {
        "name": name,
        "credentials": [{"accessKey": access, "secretKey": secret}],
        "actions": actions,
    }


@pytest.fixture
def seaweed_with_identities(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A SeaweedFS whose only credentials are an admin's, a writer's and a maintenance host's;
    the bucket's policy denies the writer deletes of the store's data. Yields the store URL."""
    config = {
        "identities": [
            identity(
                "admin", DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, ["Admin", "Read", "Write", "List"]
            ),
            identity("writer", "writer-key", "writer-secret", ["Read", "Write", "List"]),
            identity("maintenance", "maint-key", "maint-secret", ["Read", "Write", "List"]),
        ]
    }
    (tmp_path / "s3.json").write_text(json.dumps(config))
    server = SeaweedServer(
        tmp_path / "seaweed", weed=require_weed(), s3_config=tmp_path / "s3.json"
    )
    server.start()
    try:
        admin = server.client()
        admin.create_bucket(Bucket=BUCKET)
        deny = {
            "Effect": "Deny",
            "Principal": {"AWS": ["arn:aws:iam::000000000000:user/writer"]},
            "Action": ["s3:DeleteObject"],
            "Resource": [f"arn:aws:s3:::{BUCKET}/{PREFIX}/{root}/*" for root in PROTECTED],
        }
        policy = {"Version": "2012-10-17", "Statement": [deny]}
        admin.put_bucket_policy(Bucket=BUCKET, Policy=json.dumps(policy))
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
        monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
        for leaking in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "CAS_KEY"):
            monkeypatch.delenv(leaking, raising=False)
        yield f"s3://{BUCKET}/{PREFIX}"
    finally:
        server.stop()


def weights(step: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(step).standard_normal(100_000).astype("f4")}


def as_credential(monkeypatch: pytest.MonkeyPatch, access: str, secret: str) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)


def client(access: str, secret: str) -> Any:
    return boto3.client(
        "s3",
        aws_access_key_id=access,
        aws_secret_access_key=secret,
        config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}),
    )


def test_a_writer_credential_saves_and_moves_refs_but_cannot_delete_checkpoint_data(
    seaweed_with_identities: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = seaweed_with_identities
    as_credential(monkeypatch, "writer-key", "writer-secret")
    writer = cas.open(url, append_only=True)
    for step in (1, 2, 3):
        writer.save(weights(step), f"runs/r1/ckpt_{step}")
    writer.save(weights(4), "runs/r1/ckpt_1")  # a ref moved, not deleted
    writer.close()
    s3 = client("writer-key", "writer-secret")
    chunks = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/chunks/")["Contents"]
    with pytest.raises(ClientError, match="AccessDenied"):
        s3.delete_object(Bucket=BUCKET, Key=chunks[0]["Key"])
    assert s3.head_object(Bucket=BUCKET, Key=chunks[0]["Key"])
    # Even a handle that is not append-only cannot make the writer's credential forget.
    unguarded = cas.open(url)
    with pytest.raises(cas.CASError):
        unguarded.forget(RetentionPolicy(rules=(Rule(select="runs/r1/*", keep_last=1),)))
    assert len(unguarded.ref_names("runs/r1/*")) == 3

    as_credential(monkeypatch, "maint-key", "maint-secret")
    maintenance = cas.open(url)
    maintenance.forget(RetentionPolicy(rules=(Rule(select="runs/r1/*", keep_last=1),)))
    assert maintenance.ref_names("runs/r1/*") == ["runs/r1/ckpt_1"]  # the last one saved
    time.sleep(1.1)  # S3 stamps whole seconds: grace 0 still spares objects of GC's own second
    freed = maintenance.plan_gc(GCSettings(grace=0, reflog_window=0)).execute()
    assert freed.deleted_chunks > 0
    assert np.array_equal(maintenance.load("runs/r1/ckpt_1")["w"], weights(4)["w"])
