"""What the remote tier asks of S3: a drain asks nothing it already knows, a resume on a new node
writes nothing there, and bodies sent over TLS are not hashed a second time for the signature."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore.awsrequest
import botocore.client
import pytest
import torch

import cas
from cas.blobstore.s3.client import S3Options, make_client
from cas.codecs import codec_by_name
from cas.errors import BackendError
from cas.objects.keys import ObjectKind, object_key
from cas.objects.store import ObjectStore
from cas.repo.config import StoreConfig
from cas.retention.policy import RetentionPolicy, Rule
from cas.training.manager import CheckpointManager
from tests.helpers import assert_bit_exact, local_root

CKPT = "runs/r1/phase1/ckpt_phase1_step{:08d}"


def _open(root: Path) -> cas.Repository:
    return cas.open(root, config=StoreConfig(chunk_size=4096))


def _state(step: int) -> dict[str, torch.Tensor]:
    """A frozen part every checkpoint shares and a head that changes with ``step``."""
    frozen = torch.randn(16384, generator=torch.Generator().manual_seed(0))
    head = torch.randn(2048, generator=torch.Generator().manual_seed(step))
    return {"frozen": frozen, "head": head}


@pytest.fixture
def s3_requests(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Every S3 operation any client of this process makes, counted by name."""
    seen: collections.Counter[str] = collections.Counter()
    original = botocore.client.BaseClient._make_api_call

    def counted(self: Any, operation: str, params: dict[str, Any]) -> Any:
        seen[operation] += 1
        return original(self, operation, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", counted)
    yield seen


def test_a_drain_asks_the_remote_for_none_of_the_chunks_its_last_checkpoint_left_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    asked: list[int] = []
    original = ObjectStore.missing

    def missing(self: ObjectStore, kind: Any, digests: Any) -> Any:
        asked.append(len(digests))
        return original(self, kind, digests)

    monkeypatch.setattr(ObjectStore, "missing", missing)
    with CheckpointManager(local, run="r1", signals=False, remote=remote) as mgr:
        assert mgr.tier is not None
        for step in (1, 2, 3):
            mgr.save(step, _state(step)).result()
            assert mgr.tier.wait(30).saves == 0
    # The first drain of the run asks which chunks the remote has; the later ones know. (The
    # history's pushes ask about its chunks: none while its records fit in its head.)
    assert [n for n in asked if n] == [asked[0]] and asked[0] > 4
    for step in (1, 2, 3):
        assert_bit_exact(remote.load(CKPT.format(step))["state"], _state(step))


def test_a_drain_trusting_chunks_swept_from_the_remote_since_stores_them_again(
    tmp_path: Path,
) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    for step in (1, 2):
        local.save(_state(step), CKPT.format(step))
    local.drain_to(remote, CKPT.format(1), latest=None)
    known = frozenset(local.manifest(CKPT.format(1)).chunk_digests())
    # A GC on the remote swept a frozen chunk since (the drain's knowledge is stale), and
    # another writer stored a head chunk of step 2 there (the drain takes it for missing).
    swept = next(iter(set(local.manifest(CKPT.format(2)).chunk_digests()) & known))
    remote.objects.blobs.delete(object_key(ObjectKind.CHUNK, swept))
    stored_by_other = next(iter(set(local.manifest(CKPT.format(2)).chunk_digests()) - known))
    data = local.objects.get_chunk(stored_by_other)
    remote.objects.put_chunk(data, codec_by_name("zstd"), expected=stored_by_other)
    report = local.drain_to(remote, CKPT.format(2), latest=None, known=known)
    assert report.transfer is not None and report.transfer.lookup == "known"
    assert_bit_exact(remote.load(CKPT.format(2)), _state(2))
    assert remote.objects.has_chunk(swept)


def test_resuming_on_a_new_node_writes_nothing_to_s3_before_the_first_step(
    tmp_path: Path, s3_url: str, s3_requests: collections.Counter[str]
) -> None:
    with CheckpointManager(
        _open(tmp_path / "node1"), run="r1", signals=False, remote=s3_url
    ) as mgr:
        assert mgr.tier is not None
        for step in (1, 2):
            mgr.save(step, _state(step)).result()
        assert mgr.tier.wait(60).saves == 0
    s3_requests.clear()
    mgr = CheckpointManager(_open(tmp_path / "node2"), run="r1", signals=False, remote=s3_url)
    restored = mgr.restore("auto")
    assert (restored.mode, restored.step) == ("resume", 2)
    assert_bit_exact(restored.state, _state(2))
    # No conditional-write probe, no writer lease: the resume only reads the remote.
    writes = {op: n for op, n in s3_requests.items() if not op.startswith(("Get", "Head", "List"))}
    assert writes == {}
    mgr.close()


def test_a_run_on_a_new_node_with_no_remote_store_yet_starts_fresh_without_creating_one(
    tmp_path: Path,
) -> None:
    remote_dir = tmp_path / "remote"
    mgr = CheckpointManager(
        _open(tmp_path / "node"), run="r1", signals=False, remote=str(remote_dir)
    )
    assert mgr.restore("auto").mode == "fresh"
    assert not remote_dir.exists()  # the first drain creates it
    mgr.save(1, _state(1)).result()
    assert mgr.tier is not None and mgr.tier.wait(30).saves == 0
    mgr.close()
    assert_bit_exact(cas.open(remote_dir).load(CKPT.format(1))["state"], _state(1))


class _Raw:
    """An empty HTTP body for a faked response."""

    def stream(self) -> Iterator[bytes]:
        yield b""


def test_bodies_sent_over_tls_are_not_hashed_for_the_signature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over TLS a PutObject is signed UNSIGNED-PAYLOAD (blake3 checks each chunk when read);
    over plain HTTP its body stays signed."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    sent: dict[str, str] = {}

    def capture(request: Any, **_: Any) -> botocore.awsrequest.AWSResponse:
        sent[request.url.split(":")[0]] = request.headers["X-Amz-Content-SHA256"].decode()
        return botocore.awsrequest.AWSResponse(request.url, 200, {}, _Raw())

    for endpoint in ("https://s3.example.invalid", "http://s3.example.invalid"):
        options = S3Options(endpoint_url=endpoint, region_name="us-east-1")
        client = make_client(options)
        client.meta.events.register("before-send.s3.PutObject", capture)
        client.put_object(Bucket="b", Key="k", Body=b"x" * 1000)
    assert sent["https"] == "UNSIGNED-PAYLOAD"
    assert len(sent["http"]) == 64  # the body's SHA-256


def test_a_checkpoint_the_remote_policy_removed_is_not_pushed_again(tmp_path: Path) -> None:
    """The local tier keeps every checkpoint, the remote its last two: each checkpoint goes up
    once, and one the remote policy removed stays local-only rather than going up after
    every save (and being removed again)."""
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    keep_two = RetentionPolicy(rules=(Rule("runs/*/phase*/ckpt_*", keep_last=2),))
    with CheckpointManager(
        local, run="r1", signals=False, remote=remote, remote_policy=keep_two
    ) as mgr:
        assert mgr.tier is not None
        for step in range(1, 6):
            mgr.save(step, _state(step)).result()
            assert mgr.tier.wait(30).saves == 0
        mgr.tier.wake()  # a cycle with nothing new: it pushes nothing either
        lag = mgr.tier.wait(30)
        assert (mgr.tier.drained, lag.saves, lag.skipped) == (5, 0, 3)
    assert remote.ref_names("runs/r1/phase1/ckpt_*") == [CKPT.format(s) for s in (4, 5)]
    assert len(local.ref_names("runs/r1/phase1/ckpt_*")) == 5


def test_a_checkpoint_passed_over_is_not_asked_for_on_the_remote_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    keep_two = RetentionPolicy(rules=(Rule("runs/*/phase*/ckpt_*", keep_last=2),))
    asked_at: list[int] = []  # the save during whose drain the remote was asked for step 1
    current = [0]
    refs = remote.stores.refs
    original = refs.try_get

    def try_get(name: str) -> Any:
        if name == CKPT.format(1):
            asked_at.append(current[0])
        return original(name)

    monkeypatch.setattr(refs, "try_get", try_get)
    with CheckpointManager(
        local, run="r1", signals=False, remote=remote, remote_policy=keep_two
    ) as mgr:
        assert mgr.tier is not None
        for step in range(1, 9):
            current[0] = step
            mgr.save(step, _state(step)).result()
            assert mgr.tier.wait(30).saves == 0
    # Step 1 left the remote at the third save's forget and was passed over at the fourth;
    # the four drains after that ask the remote nothing about it.
    assert asked_at and max(asked_at) <= 4


def test_a_drained_checkpoint_is_asked_for_on_the_remote_once_however_long_it_stays_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local tier keeps every checkpoint: each later drain's scan would otherwise read the
    remote ref of every one of them (a request per checkpoint per save, growing all run)."""
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    asked: collections.Counter[str] = collections.Counter()
    refs = remote.stores.refs
    original = refs.try_get

    def try_get(name: str) -> Any:
        asked[name] += 1
        return original(name)

    monkeypatch.setattr(refs, "try_get", try_get)
    with CheckpointManager(local, run="r1", signals=False, remote=remote) as mgr:
        assert mgr.tier is not None
        for step in range(1, 9):
            mgr.save(step, _state(step)).result()
            assert mgr.tier.wait(30).saves == 0
    scans = {name: n for name, n in asked.items() if "ckpt_" in name}
    assert sorted(scans) == [CKPT.format(s) for s in range(1, 9)]
    # Asked by the scan that found it pending and once by the drain that moved it (which then
    # knows the remote's latest may name it); never by a later save's scan.
    assert max(scans.values()) <= 2, scans
    assert remote.ref_names("runs/r1/phase1/ckpt_*") == [CKPT.format(s) for s in range(1, 9)]


def test_a_backlog_drained_after_an_outage_asks_the_remote_for_each_checkpoint_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six saves made while the remote is down are drained in one cycle once it is back. Each
    drain moves the remote's ``latest`` after its checkpoint; the newer checkpoints still
    waiting are known not to be there, and the one just pushed known to be, so neither is read
    from the remote for that (before, every drain of a backlog read the ref of each newer one:
    the last checkpoint of six was asked for eight times)."""
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    asked: collections.Counter[str] = collections.Counter()
    down = [True]
    refs = remote.stores.refs
    original = refs.try_get

    def try_get(name: str) -> Any:
        if down[0]:
            raise BackendError("remote unreachable (test)")
        asked[name] += 1
        return original(name)

    monkeypatch.setattr(refs, "try_get", try_get)
    with CheckpointManager(local, run="r1", signals=False, remote=remote, remote_retry=0.05) as mgr:
        assert mgr.tier is not None
        for step in range(1, 7):
            mgr.save(step, _state(step)).result()
        assert mgr.tier.wait(0.2).saves == 6  # nothing reached the remote
        down[0] = False
        # ``wait`` returns at once while the last attempt's error stands: poll until caught up.
        deadline = time.monotonic() + 30
        while mgr.tier.wait(1).saves and time.monotonic() < deadline:
            time.sleep(0.02)
        assert mgr.tier.wait(30).saves == 0
    scans = {name: n for name, n in asked.items() if "ckpt_" in name}
    assert sorted(scans) == [CKPT.format(s) for s in range(1, 7)]
    # Once by the scan that found it waiting, once by the drain that pushed it.
    assert max(scans.values()) <= 2, scans
    assert remote.resolve("runs/r1/latest") == local.resolve(CKPT.format(6))
    for step in range(1, 7):
        assert_bit_exact(remote.load(CKPT.format(step))["state"], _state(step))


def test_a_cycle_with_no_checkpoint_and_no_pointer_moved_asks_the_remote_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    with CheckpointManager(
        local, run="r1", signals=False, best=("loss", "min"), remote=remote
    ) as mgr:
        assert mgr.tier is not None
        mgr.save(1, _state(1), {"loss": 1.0}).result()
        assert mgr.tier.wait(30).saves == 0
        calls: list[str] = []
        blobs = remote.blobs
        for name in ("get", "get_versioned", "put", "put_conditional", "put_if_absent", "has"):
            original = getattr(blobs, name)

            def counted(key: str, *args: Any, _original: Any = original, _n: str = name) -> Any:
                calls.append(f"{_n} {key}")
                return _original(key, *args)

            monkeypatch.setattr(blobs, name, counted)
        mgr.tier.wake()
        assert mgr.tier.wait(30).saves == 0
        assert calls == []  # no lease taken, no ref read: nothing moved
        mgr.promote_gate("bc_best")  # a pointer moved alone: the next cycle pushes it
        assert mgr.tier.wait(30).saves == 0
        assert any("gates" in call for call in calls), calls
    assert remote.resolve("runs/r1/gates/bc_best") == local.resolve(CKPT.format(1))


def test_a_gate_promoted_onto_a_checkpoint_passed_over_brings_it_to_the_remote(
    tmp_path: Path,
) -> None:
    local, remote = _open(tmp_path / "local"), _open(tmp_path / "remote")
    rule = Rule("runs/*/phase*/ckpt_*", keep_last=1, protect_targets_of=("runs/*/gates/*",))
    policy = RetentionPolicy(rules=(rule,))
    with CheckpointManager(
        local, run="r1", signals=False, best=("loss", "min"), remote=remote, remote_policy=policy
    ) as mgr:
        assert mgr.tier is not None
        for step, loss in ((1, 1.0), (2, 3.0), (3, 2.0)):
            mgr.save(step, _state(step), {"loss": loss}).result()
            assert mgr.tier.wait(30).saves == 0
        assert remote.ref_names("runs/r1/phase1/ckpt_*") == [CKPT.format(3)]
        mgr.promote_gate("bc_best")  # from best: step 1, which the remote let go
        assert mgr.tier.wait(30).saves == 0
    assert remote.resolve(CKPT.format(1)) == local.resolve(CKPT.format(1))
    assert remote.resolve("runs/r1/gates/bc_best") == local.resolve(CKPT.format(1))


def _drained_run_and_a_node_with_the_base(tmp_path: Path) -> tuple[cas.Repository, cas.Repository]:
    """A remote holding two drained checkpoints of run r1, and a new node whose local store
    caches only the frozen base they share."""
    remote = _open(tmp_path / "remote")
    with CheckpointManager(
        _open(tmp_path / "node1"), run="r1", signals=False, remote=remote
    ) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step)).result()
        assert mgr.tier is not None and mgr.tier.wait(30).saves == 0
    node2 = _open(tmp_path / "node2")
    node2.save({"frozen": _state(0)["frozen"]}, "models/base")  # the base, cached here
    return remote, node2


def _count_reads(blobs: Any, monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """How often each chunk of ``blobs`` is read, whole or in part, by digest."""
    read: collections.Counter[str] = collections.Counter()
    for name in ("get", "get_range"):
        original = getattr(blobs, name)

        def counted(key: str, *args: Any, _original: Any = original) -> Any:
            if key.startswith("chunks/"):
                read[key.rsplit("/", 1)[-1]] += 1
            return _original(key, *args)

        monkeypatch.setattr(blobs, name, counted)
    return read


def test_a_resume_reads_from_the_remote_only_the_chunks_this_node_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote, node2 = _drained_run_and_a_node_with_the_base(tmp_path)
    cached = set(node2.manifest("models/base").chunk_digests())
    read = _count_reads(remote.objects.blobs, monkeypatch)
    mgr = CheckpointManager(node2, run="r1", signals=False, remote=remote)
    restored = mgr.restore("auto")
    assert_bit_exact(restored.state, _state(2))
    chunks = set(read)
    wanted = set(remote.manifest(CKPT.format(2)).chunk_digests())
    assert chunks == wanted - cached  # the head and the RNG states, none of the base
    assert cached & wanted
    mgr.close()


@pytest.mark.parametrize("handed", [True, False])
def test_a_checkpoint_a_resume_loaded_from_the_remote_joins_the_local_tier_without_a_second_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handed: bool
) -> None:
    from cas.repo.repository import KeptObjects

    if not handed:  # as before the objects a load read were kept
        monkeypatch.setattr(KeptObjects, "add", lambda self, key, data: None)
    remote, node2 = _drained_run_and_a_node_with_the_base(tmp_path)
    read = _count_reads(remote.objects.blobs, monkeypatch)
    mgr = CheckpointManager(node2, run="r1", signals=False, remote=remote)
    assert_bit_exact(mgr.restore("auto").state, _state(2))
    loaded = dict(read)
    assert loaded and set(loaded.values()) == {1}
    assert node2.find_ref(CKPT.format(2)) is None  # loaded from the remote, nothing written
    mgr.close()  # adopts the checkpoint into the local tier (as the run's next save would)
    assert node2.find_ref(CKPT.format(2)) is not None
    assert_bit_exact(node2.load(CKPT.format(2))["state"], _state(2))
    # What the load read, the pull took from memory; with nothing kept, it read it all again.
    assert dict(read) == (loaded if handed else {d: 2 for d in loaded})


def test_a_checkpoint_too_large_to_keep_is_pulled_first_and_crosses_the_network_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cas.training.tier_resume as tier_resume

    remote, node2 = _drained_run_and_a_node_with_the_base(tmp_path)
    cached = set(node2.manifest("models/base").chunk_digests())
    lacking = set(remote.manifest(CKPT.format(2)).chunk_digests()) - cached
    monkeypatch.setattr(tier_resume, "KEEP_BYTES", 4096)  # less than the chunks node2 lacks
    read = _count_reads(remote.objects.blobs, monkeypatch)
    mgr = CheckpointManager(node2, run="r1", signals=False, remote=remote)
    restored = mgr.restore("auto")
    assert_bit_exact(restored.state, _state(2))
    assert node2.find_ref(CKPT.format(2)) is not None  # in the local tier before the first step
    mgr.close()
    assert dict(read) == {d: 1 for d in lacking}  # the cached base was not read either
    assert_bit_exact(node2.load(CKPT.format(2))["state"], _state(2))


def test_a_resume_that_finds_a_cached_base_chunk_corrupt_heals_it_from_the_remote(
    tmp_path: Path,
) -> None:
    remote, node2 = _drained_run_and_a_node_with_the_base(tmp_path)
    digest = next(iter(node2.manifest("models/base").chunk_digests()))
    path = local_root(node2) / f"chunks/{digest[:2]}/{digest}"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with CheckpointManager(node2, run="r1", signals=False, remote=remote) as mgr:
        restored = mgr.restore("auto")
        assert (restored.step, restored.fallbacks) == (2, [])
        assert_bit_exact(restored.state, _state(2))
    assert_bit_exact(node2.load("models/base")["frozen"], _state(0)["frozen"])


def test_a_resume_between_encrypted_tiers_pulls_the_checkpoint_first_and_loads_it(
    tmp_path: Path,
) -> None:
    def sealed(name: str) -> cas.Repository:
        return cas.open(tmp_path / name, key="tier passphrase", config=StoreConfig(chunk_size=4096))

    remote = sealed("remote")
    with CheckpointManager(sealed("node1"), run="r1", signals=False, remote=remote) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step)).result()
        assert mgr.tier is not None and mgr.tier.wait(30).saves == 0
    node2 = sealed("node2")
    with CheckpointManager(node2, run="r1", signals=False, remote=remote) as mgr:
        restored = mgr.restore("auto")
        assert (restored.mode, restored.step) == ("resume", 2)
        assert_bit_exact(restored.state, _state(2))
        # No read through to the remote between two keys: the checkpoint is here already.
        assert node2.resolve("runs/r1/latest") == remote.resolve(CKPT.format(2))
