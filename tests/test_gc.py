"""GC: mark from refs and recent history, sweep old unreachable objects, refuse on unreadable ones."""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cas import Repository
from cas.blobstore import LocalBlobStore, MemoryBlobStore, ReadOnlyBlobStore
from cas.blobstore.retry import RetryingBlobStore
from cas.cli import cli
from cas.codecs import codec_by_name
from cas.errors import FormatError, LeaseExpired, NotFound, RefConflict
from cas.model.manifest import ChunkRef, Manifest, TensorEntry
from cas.model.state import encode_state
from cas.objects.store import chunk_key, manifest_key
from cas.objects.sweep import TRASH_DIR, LocalSweeper, Sweeper, sweeper_for
from cas.refs.leases import WriterLease
from cas.repo.config import StoreConfig
from cas.retention.gc import GCSettings
from cas.retention.policy import RetentionPolicy, Rule
from tests.helpers import assert_bit_exact, local_root
from tests.retention_helpers import (
    CHUNK,
    FakeClock,
    chunk_digests,
    chunks_of,
    local_repo,
    memory_repo,
    reachable_chunks,
    state,
    tensor,
)

LeaseHold = AbstractContextManager[WriterLease | None]
"""What ``repo.leases.hold()`` returns: entered, it yields the held lease."""


def age_files(root: Path, seconds: float) -> None:
    """Make every object of a local store look ``seconds`` old."""
    past = time.time() - seconds
    for sub in ("chunks", "manifests"):
        for path in (root / sub).rglob("*"):
            if path.is_file():
                os.utime(path, (past, past))


def test_gc_frees_unreachable_chunks_only_after_the_grace_period() -> None:
    clock = FakeClock(1_000_000.0)
    repo = memory_repo(clock)
    repo.save(state(1, 2), "runs/r1/a")
    repo.save(state(2, 3), "runs/r1/b")
    repo.rm("runs/r1/a")
    settings_ = GCSettings(grace=3600, reflog_window=0)
    clock.advance(1800)
    young = repo.plan_gc(settings_)
    assert young.chunks == () and young.young_manifests == 1
    clock.advance(1801)
    plan = repo.plan_gc(settings_)
    assert set(plan.chunks) == chunks_of(1) and len(plan.manifests) == 1
    result = plan.execute()
    assert result.deleted_chunks == 2 and result.deleted_manifests == 1
    assert chunk_digests(repo) == chunks_of(2, 3)
    assert_bit_exact(repo.load("runs/r1/b"), state(2, 3))


def test_ref_history_keeps_overwritten_checkpoints_for_the_reflog_window() -> None:
    clock = FakeClock(1_000_000.0)
    repo = memory_repo(clock)
    repo.save(state(1), "runs/r1/latest")
    clock.advance(600)
    repo.save(state(2), "runs/r1/latest")
    clock.advance(7200)
    kept = repo.plan_gc(GCSettings(grace=0, reflog_window=3 * 3600))
    assert kept.history_manifests == 1 and kept.chunks == ()
    assert_bit_exact(repo.load("runs/r1/latest~1"), state(1))
    plan = repo.plan_gc(GCSettings(grace=0, reflog_window=3600))
    assert set(plan.chunks) == chunks_of(1)
    plan.execute()
    with pytest.raises(NotFound):
        repo.load("runs/r1/latest~1")


def test_gc_deletes_nothing_while_a_corrupt_manifest_or_a_garbage_ref_hides_what_it_reaches(
    tmp_path: Path,
) -> None:
    repo = local_repo(tmp_path)
    repo.save(state(1), "good")
    digest = repo.save(state(2), "bad")
    repo.save(state(3), "garbage")
    repo.rm("garbage")
    before = chunk_digests(repo)
    settings_ = GCSettings(grace=0, reflog_window=0)
    path = local_root(repo) / manifest_key(digest)
    original = path.read_bytes()
    path.write_bytes(original[:-3] + b"xyz")
    plan = repo.plan_gc(settings_)
    assert plan.held and plan.chunks == () and plan.manifests == () and plan.withheld_bytes > 0
    assert [d.holds for d in plan.damaged] == [True] and "ref 'bad'" in plan.damaged[0].ref
    assert not path.exists()  # the read that found it corrupt moved it into quarantine
    plan.execute()
    assert chunk_digests(repo) == before
    assert repo.plan_gc(settings_).held  # quarantined, not merely missing: it can be repaired
    shutil.rmtree(local_root(repo) / "quarantine")  # now it is merely missing
    plan = repo.plan_gc(settings_)
    assert plan.broken_refs == ("bad",) and not plan.held  # set aside, the rest collected
    path.write_bytes(original)
    ref_path = tmp_path / "refs" / "good"
    ref_path.write_bytes(b"not msgpack \xff")  # names nothing: what it kept is unknown
    plan = repo.plan_gc(settings_)
    assert plan.held and plan.chunks == ()
    assert [(d.ref, d.holds) for d in plan.damaged] == [("good", True)]
    plan.execute()
    assert chunk_digests(repo) == before
    ref_path.unlink()
    repo.save(state(1), "good")
    repo.plan_gc(settings_).execute()
    assert chunk_digests(repo) == chunks_of(1, 2)


def test_a_ref_naming_a_missing_manifest_is_reported_and_the_rest_still_collected(
    tmp_path: Path,
) -> None:
    repo = local_repo(tmp_path)
    repo.save(state(1), "good")
    lost = repo.save(state(2), "broken")
    repo.save(state(3), "garbage")
    repo.rm("garbage")
    (local_root(repo) / manifest_key(lost)).unlink()
    plan = repo.plan_gc(GCSettings(grace=0, reflog_window=0))
    assert plan.broken_refs == ("broken",)
    assert any("'broken' names a missing manifest" in line for line in plan.summary())
    plan.execute()
    assert chunk_digests(repo) == chunks_of(1)
    assert_bit_exact(repo.load("good"), state(1))
    problems = repo.verify().problems
    assert [(p.ref, p.kind) for p in problems] == [("broken", "missing-manifest")]


def test_delta_bases_named_in_the_manifest_stay_alive() -> None:
    clock = FakeClock(1_000_000.0)
    repo = memory_repo(clock)
    raw = codec_by_name("raw")
    base, delta = tensor(1, CHUNK).numpy().tobytes(), tensor(2, CHUNK).numpy().tobytes()
    base_digest = repo.objects.put_chunk(base, raw).digest
    delta_digest = repo.objects.put_chunk(delta, raw).digest
    entry = TensorEntry(
        "torch",
        "float32",
        (CHUNK // 4,),
        CHUNK,
        (ChunkRef(delta_digest, CHUNK),),
        None,
        {"base": [base_digest]},
    )
    tree = {"~": "dict", "items": [["w", {"~": "tensor", "i": 0}]]}
    repo.commit(Manifest("state", (entry,), tree, created_at=clock()), "ft/step1")
    clock.advance(10_000)
    assert repo.plan_gc(GCSettings(grace=0, reflog_window=0)).chunks == ()
    repo.rm("ft/step1")
    plan = repo.plan_gc(GCSettings(grace=0, reflog_window=0))
    assert set(plan.chunks) == {base_digest, delta_digest}


def test_a_manifest_that_lost_its_ref_race_keeps_its_chunks_through_grace() -> None:
    clock = FakeClock(1_000_000.0)
    repo = memory_repo(clock)
    repo.save(state(1), "gates/bc_best", expected=None)
    with pytest.raises(RefConflict, match="is stored, retry or point a ref at it"):
        repo.save(state(2), "gates/bc_best", expected=None)
    clock.advance(60)
    plan = repo.plan_gc(GCSettings(grace=600, reflog_window=0))
    assert plan.young_manifests == 1 and plan.chunks == () and plan.manifests == ()
    clock.advance(600)
    plan = repo.plan_gc(GCSettings(grace=600, reflog_window=0))
    assert set(plan.chunks) == chunks_of(2) and len(plan.manifests) == 1


def test_chunk_reused_after_planning_is_put_back(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    repo.save(state(1, 2), "runs/r1/a")
    repo.rm("runs/r1/a")
    age_files(tmp_path, 7200)
    plan = repo.plan_gc(GCSettings(grace=3600, reflog_window=0))
    assert set(plan.chunks) == chunks_of(1, 2)
    repo.save(state(2, 3), "runs/r1/b")  # reuses (touches) the chunks of tensor 2 meanwhile
    result = plan.execute()
    assert result.deleted_chunks == 2 and result.spared == 2
    assert repo.verify(level="full").ok
    assert_bit_exact(repo.load("runs/r1/b"), state(2, 3))
    assert not any((tmp_path / TRASH_DIR).iterdir())


@pytest.mark.parametrize("only", [None, "t1"])
def test_a_copy_of_an_old_history_entry_made_after_planning_survives_the_sweep(
    tmp_path: Path, only: str | None
) -> None:
    repo = local_repo(tmp_path)
    repo.save(state(1, 2), "runs/r1/a")
    repo.save(state(3), "runs/r1/a")
    age_files(tmp_path, 7200)
    # GC's "now" is a file mtime, which the kernel's coarse clock can put a few ms before the
    # time.time() the ref history recorded; let the overwrite be clearly in the past.
    time.sleep(0.05)
    plan = repo.plan_gc(GCSettings(grace=3600, reflog_window=0))
    assert chunks_of(1, 2) <= set(plan.chunks) and plan.manifests
    repo.cp("runs/r1/a~1", "gates/restored", only=only)  # between planning and the sweep
    plan.execute()
    assert repo.verify(level="full").ok
    expected = state(1, 2) if only is None else {"t1": state(1, 2)["t1"]}
    assert_bit_exact(repo.load("gates/restored"), expected)


def test_objects_left_in_the_trash_by_a_killed_gc_are_put_back(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    repo.save(state(1), "keep")
    victim = sorted(chunks_of(1))[0]
    (tmp_path / TRASH_DIR).mkdir(parents=True, exist_ok=True)
    os.rename(
        local_root(repo) / chunk_key(victim),
        tmp_path / TRASH_DIR / chunk_key(victim).replace("/", "+"),
    )
    assert not repo.verify().ok
    repo.plan_gc(GCSettings(grace=0, reflog_window=0))
    assert repo.verify(level="full").ok


def test_stale_temp_files_go_after_the_grace_period_and_locks_stay(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    repo.save(state(1), "keep")
    tmp = tmp_path / "tmp"
    old, new = tmp / ("a" * 32 + ".tmp"), tmp / ("b" * 32 + ".tmp")
    old.write_bytes(b"x" * 100)
    new.write_bytes(b"y" * 100)
    past = time.time() - 7200
    os.utime(old, (past, past))
    locks = set((tmp / "locks").iterdir())
    assert locks
    plan = repo.plan_gc(GCSettings(grace=3600, reflog_window=0))
    assert plan.tmp_files == (old.name,)
    assert plan.execute().deleted_tmp_files == 1
    assert not old.exists() and new.exists() and locks <= set((tmp / "locks").iterdir())


def _write_under_lease(
    repo: Repository,
    seeds: tuple[int, ...],
    make_state: Callable[[tuple[int, ...]], dict[str, Any]] | None = None,
) -> tuple[LeaseHold, WriterLease, Manifest]:
    """Write the chunks of ``state(*seeds)`` (or ``make_state(seeds)``) under a lease and return
    the held lease and the manifest a commit would store; nothing is committed."""
    hold = repo.leases.hold("test writer")
    lease = hold.__enter__()
    assert lease is not None  # leases are on by default
    tree, sources = encode_state(make_state(seeds) if make_state else state(*seeds))
    entries, _ = repo.write_tensors(sources)
    return hold, lease, Manifest("state", tuple(entries), tree, created_at=repo.clock())


def test_live_writer_lease_protects_what_it_wrote_and_an_expired_one_cannot_commit() -> None:
    clock = FakeClock(1_000_000.0)
    repo = memory_repo(clock, leases={"duration": 1800, "margin": 60})
    settings_ = GCSettings(grace=600, reflog_window=0)
    hold, lease, manifest = _write_under_lease(repo, (1,))
    clock.advance(1000)  # older than the grace period, but the lease is live
    plan = repo.plan_gc(settings_)
    assert plan.chunks == () and plan.spared_chunks == 2
    assert [live.writer for live in plan.live_leases] == [lease.writer_id]
    assert "live writer lease" in "\n".join(plan.summary())
    repo.commit(manifest, "runs/r1/slow")
    hold.__exit__(None, None, None)
    assert not list(repo.blobs.list("leases/"))
    assert_bit_exact(repo.load("runs/r1/slow"), state(1))

    hold, _, manifest = _write_under_lease(repo, (2,))
    clock.advance(1800 + 61)  # paused past its lease: GC no longer honours it
    plan = repo.plan_gc(settings_)
    assert set(plan.chunks) == chunks_of(2) and len(plan.expired_leases) == 1
    assert plan.execute().reaped_leases == 1
    with pytest.raises(LeaseExpired, match="commit aborted"):
        repo.commit(manifest, "runs/r1/late")
    hold.__exit__(None, None, None)
    assert repo.refs_store.try_get("runs/r1/late") is None
    assert repo.verify().ok


def test_du_and_stats_report_dedup_and_exclusive_bytes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = local_repo(store)
    repo.save(state(1, 2), "runs/r1/ckpt_1")
    repo.save(state(2, 3), "runs/r1/ckpt_2")
    repo.cp("runs/r1/ckpt_2", "gates/best")
    runner = CliRunner()
    du = json.loads(runner.invoke(cli, ["--store", str(store), "du", "runs/r1", "--json"]).output)
    assert du["logical_bytes"] == 4 * 2 * CHUNK
    assert du["stored_bytes"] > 3 * 2 * CHUNK
    rows = {r["ref"]: r for r in du["refs"]}
    # ckpt_1 alone holds tensor 1; ckpt_2 shares everything with ckpt_1 or the gate.
    assert rows["runs/r1/ckpt_1"]["exclusive_bytes"] > 2 * CHUNK
    assert rows["runs/r1/ckpt_2"]["exclusive_bytes"] == 0
    assert du["shared_bytes"] > 2 * 2 * CHUNK  # tensors 2 and 3 are also the gate's
    stats = json.loads(runner.invoke(cli, ["--store", str(store), "stats", "--json"]).output)
    assert stats["chunks"] == 6 and stats["refs"] == 3 and stats["manifests"] == 2
    # Six tensors' worth named, three stored (plus chunk headers and the manifests).
    assert (
        stats["stored_bytes"]
        == json.loads(runner.invoke(cli, ["--store", str(store), "du", "--json"]).output)[
            "stored_bytes"
        ]
    )
    assert stats["dedup_ratio"] == round(stats["logical_bytes"] / stats["stored_bytes"], 4)
    assert 1.9 < stats["dedup_ratio"] < 2
    assert stats["compression_ratio"] < 1.0  # raw codec: headers only
    text = runner.invoke(cli, ["--store", str(store), "du", "-r"]).output
    assert "gates/best" in text and "exclusive" in text


def test_gc_dry_run_prints_the_plan_and_deletes_nothing(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = local_repo(store)
    repo.save(state(1), "a")
    repo.save(state(2), "b")
    repo.rm("a")
    before = chunk_digests(repo)
    files = {p: p.stat().st_mtime_ns for p in store.rglob("*")}
    runner = CliRunner()
    out = runner.invoke(
        cli, ["--store", str(store), "gc", "--dry-run", "--grace", "0s", "--json", "--list"]
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["plan"]["delete_chunks"] == 2 and set(doc["plan"]["chunks"]) == chunks_of(1)
    assert "result" not in doc and chunk_digests(repo) == before
    # Nothing written either (no maintenance lock, no clock probe): read-only access will do.
    assert {p: p.stat().st_mtime_ns for p in store.rglob("*")} == files
    out = runner.invoke(
        cli, ["--store", str(store), "gc", "--grace", "0s", "--reflog-window", "0s"]
    )
    assert "deleted 2 chunks and 1 manifests" in out.output
    assert chunk_digests(repo) == reachable_chunks(repo) == chunks_of(2)
    bad = runner.invoke(cli, ["--store", str(store), "gc", "--grace", "soon"])
    assert bad.exit_code == 2 and "bad duration" in bad.output


GRACE, WINDOW, LEASE, MARGIN = 100.0, 50.0, 400.0, 10.0
SEEDS = st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True)
NAMES = st.sampled_from(["runs/a/x", "runs/a/y", "runs/b/x", "gates/g"])


def positional_state(seeds: tuple[int, ...]) -> dict[str, Any]:
    """``state`` with tensors named by position, so a ref's next save changes a path's content
    (and, under a delta codec, is stored as a delta against the ref's previous target)."""
    return {f"p{i}": tensor(s, 2 * CHUNK) for i, s in enumerate(seeds)}


def recorded_bases(manifest: Manifest) -> set[str]:
    """The delta bases a manifest's tensor entries list."""
    return {base for entry in manifest.tensors for base in entry.base_digests()}


class GCModel(RuleBasedStateMachine):
    """A store driven by saves, copies, removals, slow writers, forget and GC, against a model.

    The model tracks when each chunk and manifest was last written or reused, every ref's target
    and history, and the in-flight writer's lease. After each GC the stored chunks must be
    exactly: chunks of root manifests (current targets, history inside the window, manifests
    newer than the cutoff) and the delta bases those manifests list, plus chunks newer than the
    cutoff; the cutoff is ``now - grace``, lowered to ``lease start - margin`` while a lease is
    live. Every ref must load bit-exact throughout, so a base GC wrongly deleted is caught twice.
    """

    codec = "raw"

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(1_000_000.0)
        self.repo = memory_repo(self.clock, leases={"duration": LEASE, "margin": MARGIN})
        self.settings = GCSettings(grace=GRACE, reflog_window=WINDOW)
        self.chunk_time: dict[str, float] = {}
        self.manifests: dict[str, tuple[set[str], float]] = {}
        self.refs: dict[str, tuple[str, list[tuple[str, float]], tuple[int, ...]]] = {}
        self.writer: tuple[LeaseHold, WriterLease, Manifest, tuple[int, ...], float, float] | None
        self.writer = None
        self.thread = ThreadPoolExecutor(1)

    def _stored(self, digest: str, seeds: tuple[int, ...]) -> None:
        """A save or copy wrote or reused the manifest ``digest``: its chunks and bases are fresh."""
        now = self.clock()
        bases = recorded_bases(self.repo.manifest(digest))
        needed = chunks_of(*seeds) | bases
        for chunk in needed:
            self.chunk_time[chunk] = now
        self.manifests[digest] = (needed, now)

    def _point(self, name: str, digest: str, seeds: tuple[int, ...]) -> None:
        history = self.refs[name][1] if name in self.refs else []
        self.refs[name] = (digest, [*history, (digest, self.clock())], seeds)

    @rule(name=NAMES, seeds=SEEDS)
    def save(self, name: str, seeds: list[int]) -> None:
        state = positional_state(tuple(seeds))  # "gates/g" moves freely here: overwrite
        digest = self.repo.save(state, name, codec=self.codec, overwrite=True)
        self._stored(digest, tuple(seeds))
        self._point(name, digest, tuple(seeds))

    @rule(src=NAMES, dst=NAMES)
    def cp(self, src: str, dst: str) -> None:
        if src in self.refs and src != dst:
            digest = self.repo.cp(src, dst, overwrite=True)  # "gates/g" moves freely here
            self._stored(digest, self.refs[src][2])  # cp touches what it copies
            self._point(dst, digest, self.refs[src][2])

    @rule(name=NAMES)
    def rm(self, name: str) -> None:
        if name in self.refs:
            self.repo.rm(name)
            del self.refs[name]

    @rule(seconds=st.sampled_from([1.0, 30.0, 60.0, 150.0, 500.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @precondition(lambda self: self.writer is None)
    @rule(seeds=SEEDS)
    def start_slow_write(self, seeds: list[int]) -> None:
        # Its own thread: leases are per thread, and the other rules are other writers.
        hold, lease, manifest = self.thread.submit(
            _write_under_lease, self.repo, tuple(seeds), positional_state
        ).result()
        now = self.clock()
        for chunk in chunks_of(*seeds) | recorded_bases(manifest):  # reused deltas: bases touched
            self.chunk_time[chunk] = now
        self.writer = (hold, lease, manifest, tuple(seeds), now, now + LEASE)

    @precondition(lambda self: self.writer is not None)
    @rule(name=NAMES)
    def finish_slow_write(self, name: str) -> None:
        assert self.writer is not None
        hold, _, manifest, seeds, _, expires = self.writer
        self.writer = None
        commit = functools.partial(self.repo.commit, manifest, name, overwrite=True)
        try:
            if self.clock() >= expires - MARGIN:
                with pytest.raises(LeaseExpired):
                    self.thread.submit(commit).result()
                return
            digest = self.thread.submit(commit).result()
        finally:
            self.thread.submit(hold.__exit__, None, None, None).result()
        # commit writes no chunk
        self.manifests[digest] = (chunks_of(*seeds) | recorded_bases(manifest), self.clock())
        self._point(name, digest, seeds)

    @rule()
    def forget(self) -> None:
        result = self.repo.forget(RetentionPolicy(rules=(Rule("runs/**", keep_last=1),)))
        for name in result.removed:
            del self.refs[name]

    @rule()
    def gc(self) -> None:
        now = self.clock()
        cutoff = now - GRACE
        if self.writer is not None and now < self.writer[5] + MARGIN:
            cutoff = min(cutoff, self.writer[4] - MARGIN)
        roots = {target for target, _, _ in self.refs.values()}
        roots |= {  # an entry ages from when the ref moved on from it
            d
            for _, history, _ in self.refs.values()
            for (d, _), (_, ended) in zip(history, [*history[1:], ("", now)], strict=True)
            if ended >= now - WINDOW
        }
        roots |= {d for d, (_, when) in self.manifests.items() if when >= cutoff}
        marked = set().union(*(self.manifests[d][0] for d in roots if d in self.manifests))
        expected = {c for c, when in self.chunk_time.items() if c in marked or when >= cutoff}
        self.repo.plan_gc(self.settings).execute()
        assert chunk_digests(self.repo) == expected
        assert marked <= expected  # nothing reachable is ever deleted
        self.chunk_time = {c: w for c, w in self.chunk_time.items() if c in expected}
        self.manifests = {d: v for d, v in self.manifests.items() if d in roots}

    @rule()
    def gc_once_everything_is_past_the_grace_period(self) -> None:
        self.advance(GRACE + 1.0)
        self.gc()

    @invariant()
    def every_ref_is_loadable(self) -> None:
        for name, (target, _, _) in self.refs.items():
            assert self.repo.resolve(name) == target
            assert self.repo.verify([name]).ok, name

    def teardown(self) -> None:
        if self.writer is not None:
            self.thread.submit(self.writer[0].__exit__, None, None, None).result()
        self.thread.shutdown()
        for name, (_, _, seeds) in self.refs.items():
            assert_bit_exact(self.repo.load(name), positional_state(seeds))


class GCModelWithDeltas(GCModel):
    """The model with every save XOR-delta'd against the ref's previous target: a GC that
    forgets a delta base deletes a chunk a live ref still needs, and the model says so."""

    codec = "xor-delta"

    @rule(name=NAMES, seeds=st.lists(st.integers(0, 30), min_size=1, max_size=3, unique=True))
    def save(self, name: str, seeds: list[int]) -> None:
        # More seeds than the base model: a base that fewer refs share is more often one that
        # only a delta keeps alive, which is the case this model exists for.
        super().save(name, seeds)


TestGCModel = GCModel.TestCase
TestGCModel.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestGCModelWithDeltas = GCModelWithDeltas.TestCase
# 60 examples: with a GC that forgot delta bases planted, 24 runs of 60 all failed (of 40: 23).
TestGCModelWithDeltas.settings = settings(TestGCModel.settings, max_examples=60)


def test_gc_without_settings_uses_the_grace_and_reflog_window_stored_in_the_config() -> None:
    # The stored settings differ from the defaults (1h, 1h) in both directions, so a GC that
    # ignored the config would delete too much at 2h and too little at 2.5h.
    clock = FakeClock(1_000_000.0)
    repo = memory_repo(clock, gc={"grace": "5m", "reflog_window": "3h"})
    assert GCSettings.from_config(repo.config.extra) == GCSettings(grace=300, reflog_window=10800)
    repo.save(state(1), "runs/r1/latest")
    repo.save(state(2), "runs/r1/latest")  # state(1) lives on in the ref's history only
    clock.advance(2 * 3600)
    hold, _, _ = _write_under_lease(repo, (5,))  # a writer that gave up: orphan chunks
    hold.__exit__(None, None, None)
    assert repo.plan_gc().chunks == ()  # the 3h window keeps state(1); the orphans are young

    clock.advance(30 * 60)
    assert set(repo.plan_gc().chunks) == chunks_of(5)  # older than the 5 minute grace

    clock.advance(31 * 60)  # state(1) left the ref 3h01m ago
    plan = repo.plan_gc()
    assert set(plan.chunks) == chunks_of(1, 5)
    plan.execute()
    assert chunk_digests(repo) == chunks_of(2)
    assert_bit_exact(repo.load("runs/r1/latest"), state(2))


def test_gc_settings_in_the_config_are_checked_and_absent_by_default() -> None:
    with pytest.raises(FormatError):
        GCSettings.from_config({"gc": {"grace": "later"}})
    with pytest.raises(FormatError):
        GCSettings.from_config({"gc": "1h"})
    assert StoreConfig().extra == {}
    assert GCSettings.from_config(StoreConfig().extra) == GCSettings()


def test_a_target_overwritten_a_minute_ago_is_kept_however_long_it_was_current() -> None:
    clock = FakeClock(1_000_000.0)
    repo = memory_repo(clock)
    repo.save(state(1), "runs/r1/latest")
    clock.advance(3 * 3600)  # current for three hours...
    repo.save(state(2), "runs/r1/latest")
    clock.advance(60)  # ...and overwritten a minute ago
    plan = repo.plan_gc(GCSettings(grace=3600, reflog_window=3600))
    assert plan.history_manifests == 1 and plan.chunks == ()
    plan.execute()
    assert_bit_exact(repo.load("runs/r1/latest~1"), state(1))


def test_gc_renames_candidates_aside_only_in_a_writable_local_directory(tmp_path: Path) -> None:
    local = LocalBlobStore(tmp_path / "store")
    assert isinstance(sweeper_for(local), LocalSweeper)
    assert isinstance(sweeper_for(RetryingBlobStore(local)), LocalSweeper)
    assert type(sweeper_for(ReadOnlyBlobStore(local))) is Sweeper  # deletes go through, and fail
    assert type(sweeper_for(MemoryBlobStore())) is Sweeper
