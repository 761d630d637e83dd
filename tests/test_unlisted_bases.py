"""A delta chunk whose base its manifest does not list: GC cannot see that base, so it is refused.

GC keeps chunks alive from manifests alone (invariant 4). A hostile or damaged store can hold a
manifest whose chunk is a delta against a base the manifest leaves out: the checkpoint loads
while that base happens to be there, and breaks after the next ``gc --grace 0``. Push and pull
refuse to copy such a checkpoint, and plain ``verify`` reports it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgpack
import pytest
from click.testing import CliRunner

import cas
from cas.cli import cli
from cas.codecs import codec_by_name
from cas.digest import Digest
from cas.retention.gc import GCSettings
from cas.sync.transfer import UnlistedBase
from tests.test_delta import delta_repo, training_states

HOSTILE = "runs/hostile"


def _without_bases(repo: cas.Repository, digest: Digest) -> Digest:
    """Store a copy of manifest ``digest`` whose tensor entries list no delta bases."""
    doc: dict[str, Any] = msgpack.unpackb(repo.objects.get_manifest(digest), strict_map_key=False)
    for tensor in doc["tensors"]:
        encoding = tensor.get("encoding")
        if encoding:
            encoding.pop("base", None)
            encoding.pop("depth", None)
    return repo.objects.put_manifest(msgpack.packb(doc), codec_by_name("zstd"))


def hostile_store(root: Path) -> tuple[cas.Repository, Digest]:
    """A store whose only ref names a delta checkpoint whose manifest lists none of its bases;
    the bases are stored all the same, so the checkpoint loads today. Returns it and a chunk
    that is such a delta."""
    repo = delta_repo(root)
    first, second = training_states(2)
    repo.save(first, "runs/base")
    target = repo.save(second, "runs/base")
    hostile = _without_bases(repo, target)
    repo.set_ref(HOSTILE, hostile)
    repo.rm("runs/base")
    delta = next(
        ref.digest
        for tensor in repo.manifest(target).tensors
        if tensor.base_digests()
        for ref in tensor.chunks
        if repo.objects.chunk_base(ref.digest) is not None
    )
    repo.load(HOSTILE)  # every base is present: it loads
    return repo, delta


def test_plain_verify_flags_a_delta_chunk_whose_base_the_manifest_does_not_list(
    tmp_path: Path,
) -> None:
    repo, delta = hostile_store(tmp_path / "s")

    report = repo.verify()

    unlisted = [p for p in report.problems if p.kind == "unlisted-base"]
    assert not report.ok and unlisted
    assert {p.ref for p in unlisted} == {HOSTILE}
    assert delta in {p.digest for p in unlisted}
    assert "unlisted-base" in {p.kind for p in repo.verify(level="full").problems}
    result = CliRunner().invoke(cli, ["--store", str(tmp_path / "s"), "verify"])
    assert result.exit_code != 0
    assert "unlisted-base" in result.output


def test_plain_verify_passes_an_honest_delta_checkpoint(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s")
    for state in training_states(3):
        repo.save(state, "runs/r1")

    assert repo.verify().ok


def test_push_refuses_a_checkpoint_gc_would_break_and_publishes_nothing(tmp_path: Path) -> None:
    repo, _ = hostile_store(tmp_path / "src")
    remote = delta_repo(tmp_path / "dst")

    with pytest.raises(UnlistedBase) as caught:
        repo.push(remote, [HOSTILE])

    message = str(caught.value)
    assert "\n" not in message and f"ref {HOSTILE} " in message
    named = re.search(r"chunk ([0-9a-f]{64}), a delta against base ([0-9a-f]{64})", message)
    assert named is not None
    chunk, base = named.groups()
    assert repo.objects.chunk_base(Digest(chunk)) == base
    assert base not in repo.manifest(HOSTILE).chunk_digests()
    assert remote.refs() == []
    assert list(remote.blobs.list("manifests/")) == []


def test_pull_refuses_a_checkpoint_gc_would_break_and_publishes_nothing(tmp_path: Path) -> None:
    remote, _ = hostile_store(tmp_path / "remote")
    local = delta_repo(tmp_path / "local")

    with pytest.raises(UnlistedBase, match="does not list"):
        local.pull(remote, [HOSTILE])

    assert local.refs() == []
    assert list(local.blobs.list("manifests/")) == []


def test_cli_pull_of_such_a_checkpoint_is_one_line_and_exits_non_zero(tmp_path: Path) -> None:
    hostile_store(tmp_path / "remote")[0].close()
    delta_repo(tmp_path / "local").close()

    result = CliRunner().invoke(
        cli,
        ["--store", str(tmp_path / "local"), "pull", "--from", str(tmp_path / "remote"), HOSTILE],
    )

    assert result.exit_code != 0
    assert "does not list" in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_an_honest_delta_chain_still_pushes_and_loads_after_gc_there(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "src")
    states = training_states(3)
    for state in states:
        repo.save(state, "runs/r1")
    remote = delta_repo(tmp_path / "dst")

    repo.push(remote, ["runs/r1"])
    remote.plan_gc(GCSettings(grace=0, reflog_window=0)).execute()

    assert remote.verify(level="full").ok
    remote.load("runs/r1")
