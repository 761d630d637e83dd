"""CheckpointManager: a training run's periodic, signal and final saves, latest/best/gates, and resume.

Refs follow a run-id, phase and step layout by default (``Layout`` changes it)::

    runs/<YYYYMMDD_HHmmss>_<seed_hex8>/phase<N>/ckpt_phase<N>_step<08d>   one per save
    runs/<id>/latest              the newest save of the run (its history lists every save)
    runs/<id>/phase<N>/best       the best save of the phase by ``best=(metric, "min"|"max")``
    runs/<id>/history             the append-only training history (``cas.training.history``)
    runs/<id>/gates/<name>        ``promote_gate``: a copy that retention never prunes

A saved manifest's tree is ``{"state": <your state>, "rng": <cas.training.rng.capture()>}`` and its meta
holds step, phase, metrics, status (``running``/``interrupted``/``completed``), trigger and the
config hash (and ``schema_version``, with which a restore migrates older states:
``cas.training.schema``). Every save writes chunks, then the manifest, then the checkpoint ref, then moves
``latest`` and ``best`` by compare-and-swap: a process killed at any point leaves ``latest`` on a
complete checkpoint. A ``policy`` is a ``RetentionPolicy`` (applied with ``Repository.forget``),
anything with ``apply(repo)`` or a callable ``policy(repo)``; it runs after each save, in the
background. A ``mirror`` (a Repository or URL: the S3 archive) receives each gate and every move
of ``best`` by push, so a corrupt gate can be healed from it (``cas.training.runrefs``). A
``remote`` is a second tier every save drains to in the background (``cas.training.tiers``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cas.digest import Digest
from cas.errors import CASError, NotFound
from cas.refs.store import RefChange
from cas.repo.repository import Repository
from cas.retention.policy import RetentionPolicy
from cas.training import rng as rng_mod
from cas.training.async_save import AsyncWriter, Stager, ThreadLender
from cas.training.compat import (
    ConfigMismatch,
    StrictLoadError,
    SystemMismatch,
    TensorSpec,
    check_config,
    check_keys,
    check_system,
    config_change,
    config_hash,
    resume_meta,
)
from cas.training.history import HistoryRecord, TrainingHistory, plain_record
from cas.training.priority import background_cpus
from cas.training.restore import (
    Found,
    Restored,
    Skipped,
    load_first_good,
    resume_candidates,
    unwrap,
)
from cas.training.run_names import DEFAULT_LAYOUT, Layout, new_run_id, run_prefix
from cas.training.runrefs import RunRefs, open_mirror
from cas.training.saves import PendingSave, PreparedSave, SaveResult, retention_note, user_metadata
from cas.training.schema import Migration, SchemaMismatch, UserSchema
from cas.training.signals import SignalTriggers
from cas.training.tiers import CLOSE_WAIT, RemoteTier, explain_full_disk

if TYPE_CHECKING:
    import torch


__all__ = [
    "CheckpointManager",
    "ConfigMismatch",
    "Layout",
    "PendingSave",
    "Restored",
    "SaveResult",
    "SchemaMismatch",
    "Skipped",
    "StrictLoadError",
    "SystemMismatch",
    "TensorSpec",
    "config_hash",
    "new_run_id",
]

log = logging.getLogger("cas.training.manager")

CHECKPOINT_SCHEMA = 1
MODES = ("fresh", "warm_start", "resume", "pivot", "auto")


class CheckpointManager(RunRefs):
    """Saves and restores one training run; see the module docstring for the layout."""

    def __init__(
        self,
        repo: Repository,
        *,
        run: str | None = None,
        seed: int = 0,
        phase: int = 1,
        every_n_steps: int | None = None,
        best: tuple[str, str] | None = None,
        policy: Any = None,
        mirror: Repository | str | None = None,
        remote: Repository | str | None = None,
        remote_policy: RetentionPolicy | None = None,
        remote_queue: int = 8,
        remote_retry: float = 2.0,
        config: Any = None,
        system_hash: str | None = None,
        schema_version: int | None = None,
        migrations: Mapping[int, Migration] | None = None,
        layout: Layout = DEFAULT_LAYOUT,
        async_save: bool = True,
        max_in_flight: int = 1,
        background_nice: int | None = None,
        background_workers: int = 2,
        yield_thread: bool = False,
        signals: bool = True,
        exit_on_stop: bool = True,
        capture_rng: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if best is not None and best[1] not in ("min", "max"):
            raise ValueError(f"best must be (metric, 'min' | 'max'), got {best!r}")
        self.repo = repo
        self.seed = seed
        self.phase = phase
        self.every_n_steps = every_n_steps
        self.best = best
        self.policy = policy
        self.mirror = open_mirror(mirror)
        self.config = config
        self.config_hash = config_hash(config) if config is not None else None
        self.system_hash = system_hash
        self.schema = UserSchema(schema_version, dict(migrations or {}))
        self.layout = layout
        self.exit_on_stop = exit_on_stop
        self.capture_rng = capture_rng
        self.clock = clock
        self.run = run_prefix(run if run is not None else new_run_id(seed, clock))
        self.run_id = self.run.rsplit("/", 1)[-1]
        self.history = TrainingHistory(repo, layout.history.format(run=self.run))
        self.tier = RemoteTier.of_run(
            repo, remote, layout, self.run, phase, remote_policy, remote_queue, remote_retry
        )
        self._pending_records: list[HistoryRecord] = []
        self._records_lock = threading.Lock()
        self._stager = Stager()
        self._writer: AsyncWriter[SaveResult] | None = None
        self._write_repo = repo
        if background_nice is None:
            # docs/training.md, "Async saves": normal priority finishes in fewer slices; with a
            # core lent, low priority keeps the save's extra threads off the loop's core.
            background_nice = 10 if yield_thread else 0
        if async_save:
            self._writer = AsyncWriter(max_in_flight, nice=background_nice, cpus=background_cpus())
            # Its own chunk workers, started from the low-priority save thread (kept on
            # CAS_BACKGROUND_CPUS if set), so they inherit both; the same blobs, written past the
            # page cache where the store can (O_DIRECT halves a save's cost to the loop).
            self._write_repo = repo.for_background_writes(background_workers)
        self._write_history = TrainingHistory(self._write_repo, self.history.ref)
        self.yield_thread = yield_thread
        self._lender = ThreadLender(yield_thread)
        self._latest_known = self.latest_ref
        self._latest_target = self._read_target(self.latest_ref)
        self._best_cache: tuple[Digest, float] | None = None
        self._last_result: SaveResult | None = None
        self._retention_note: dict[str, Any] | None = None
        self.triggers = SignalTriggers()
        if signals:
            self.triggers.install()
        self._closed = False

    @property
    def stop_requested(self) -> bool:
        """SIGTERM or SIGINT arrived: the next ``step_end`` saves and stops."""
        return self.triggers.stop_requested

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a periodic save point."""
        every = self.every_n_steps
        return every is not None and every > 0 and step > 0 and step % every == 0

    def record(self, step: int, **values: Any) -> None:
        """Append a record to the training history (written with the next save or ``close``)."""
        with self._records_lock:
            self._pending_records.append(plain_record(step, values))

    def step_end(
        self, step: int, state: Any | Callable[[], Any], metrics: Mapping[str, Any] | None = None
    ) -> PendingSave | None:
        """Call after each completed step; saves when a trigger fires.

        ``state`` may be a callable, built only when a save happens. On SIGTERM/SIGINT this
        saves ``step``, waits for it, marks the run ``interrupted`` and exits with status 0
        (``SystemExit(0)``; with ``exit_on_stop=False`` it returns the save instead). With
        ``yield_thread`` it also gives back the intra-op thread lent to a save once it is written.
        """
        self._lender.reclaim()
        if self.triggers.stop_requested:
            signum = self.triggers.stop_signal
            pending = self.save(step, state, metrics, trigger="signal", status="interrupted")
            pending.result()
            self.close()
            log.warning("signal %s: saved step %d to %s and stopped", signum, step, pending.ref)
            if self.exit_on_stop:
                raise SystemExit(0)
            return pending
        if self.triggers.take_save_request():
            return self.save(step, state, metrics, trigger="signal")
        if self.should_save(step):
            return self.save(step, state, metrics, trigger="periodic")
        return None

    def finish(
        self,
        step: int,
        state: Any | Callable[[], Any],
        metrics: Mapping[str, Any] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveResult:
        """The final save of a completed run; waits for it. Signals act as before the manager.

        If the last save was this very step (a periodic save at the last step), its state is not
        written again: the checkpoint is re-committed with status ``completed`` and trigger
        ``final`` in a new manifest naming the same chunks, and ``state`` is not called.
        """
        self.wait()
        previous = self._last_result
        if previous is not None and (previous.phase, previous.step) == (self.phase, step):
            result = self._complete(previous, metrics, user_metadata(metadata))
        else:
            result = self.save(
                step, state, metrics, trigger="final", status="completed", metadata=metadata
            ).result()
        self._lender.reclaim()
        self.triggers.uninstall()
        return result

    def _complete(
        self, previous: SaveResult, metrics: Mapping[str, Any] | None, user: dict[str, Any]
    ) -> SaveResult:
        """Re-commit the checkpoint ``previous`` as the run's final one: no chunk is written."""
        start = time.perf_counter()
        manifest = self.repo.manifest(previous.digest)
        plain_metrics = plain_record(previous.step, metrics or manifest.meta.get("metrics", {}))
        plain_metrics.pop("step")
        meta = {
            **manifest.meta,
            **user,
            "trigger": "final",
            "status": "completed",
            "saved_at": self.clock(),
            "metrics": plain_metrics,
        }
        with self._records_lock:
            records, self._pending_records = self._pending_records, []
        records.append({"step": previous.step, "event": "save", "ref": previous.ref,
                        "trigger": "final", "status": "completed", "metrics": plain_metrics,
                        "same_state_as": previous.digest})  # fmt: skip
        prepared = PreparedSave(
            {},
            meta,
            previous.ref,
            previous.step,
            previous.phase,
            "final",
            "completed",
            records,
            None,
        )
        best_ref = self.layout.best.format(run=self.run, phase=previous.phase)
        with self._write_repo.lease("checkpoint"):
            digest = self._write_repo.commit(
                replace(manifest, meta=meta, created_at=self.clock()),
                previous.ref,
                expected=previous.digest,
                op="save",
                message="final",
                overwrite=True,  # the same checkpoint, re-committed as completed
            )
            self._write_history.append(records)
            best = self._write_repo.update_ref(  # best follows its checkpoint to the new manifest
                best_ref,
                lambda c: digest if c and c.target == previous.digest else RefChange.KEEP,
                op="best",
                message=previous.ref,
                overwrite=True,
            )
            result = self._publish(prepared, digest, start, manifest.logical_bytes(), 0)
        moved = best is not None and best.target == digest
        return replace(result, is_best=result.is_best or moved)

    def save(
        self,
        step: int,
        state: Any | Callable[[], Any],
        metrics: Mapping[str, Any] | None = None,
        *,
        trigger: str = "manual",
        status: str = "running",
        metadata: Mapping[str, Any] | None = None,
    ) -> PendingSave:
        """Save now. The call returns once the state is copied; the write runs in the background.

        ``metadata`` (plain data: a ``description``, ``tags``...) is stored in the manifest's
        meta next to the manager's own keys, which it may not reuse; ``cas show`` prints it.
        """
        if self._closed:
            raise CASError("the checkpoint manager is closed")
        plain_metrics = plain_record(step, metrics or {})
        plain_metrics.pop("step")
        user = user_metadata(metadata)
        phase = self.phase

        def prepare() -> PreparedSave:
            start = time.perf_counter()
            value = state() if callable(state) else state
            staging = self._stager.acquire() if self._writer is not None else None
            copied = self._stager.snapshot(value, staging) if staging is not None else value
            tree: dict[str, Any] = {"state": copied}
            if self.capture_rng:
                tree["rng"] = rng_mod.capture()
            ref = self.checkpoint_ref(step, phase)
            with self._records_lock:
                records, self._pending_records = self._pending_records, []
            records.append({"step": step, "event": "save", "ref": ref, "trigger": trigger,
                            "status": status, "metrics": plain_metrics})  # fmt: skip
            meta = {**user, **self._meta(step, phase, trigger, status, plain_metrics)}
            prepared = PreparedSave(tree, meta, ref, step, phase, trigger, status, records, staging)
            prepared.blocking = time.perf_counter() - start
            return prepared

        if self._writer is None:
            start = time.perf_counter()
            prepared = prepare()
            future: Future[SaveResult] = Future()
            try:
                future.set_result(self._write(prepared))
            except BaseException as e:
                future.set_exception(e)
                raise
            return PendingSave(future, step, prepared.ref, time.perf_counter() - start)
        self._lender.reclaim()
        future, blocked = self._writer.submit(prepare, self._write, cleanup=self._release)
        self._lender.lend(future)
        return PendingSave(future, step, self.checkpoint_ref(step, phase), blocked)

    def _release(self, prepared: PreparedSave) -> None:
        if prepared.staging is not None:
            self._stager.release(prepared.staging)

    def _meta(
        self, step: int, phase: int, trigger: str, status: str, metrics: dict[str, Any]
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "cas_checkpoint": CHECKPOINT_SCHEMA, "run": self.run_id, "phase": phase, "step": step,
            "trigger": trigger, "status": status, "metrics": metrics, "seed": self.seed,
            "saved_at": self.clock(),
        }  # fmt: skip
        meta.update(resume_meta(self.config_hash, self.config, self.system_hash))
        meta.update(self.schema.meta())
        if self._retention_note is not None:  # the policy fell behind after an earlier save
            meta["retention"] = self._retention_note
        return meta

    def _write(self, prepared: PreparedSave) -> SaveResult:
        # One writer lease for the checkpoint, the history append and the pointer refs: a lease
        # is a durable file write and delete, and holding one per commit doubled them per save.
        if self.tier is not None and self.tier.settle():  # adopted what a resume loaded
            self._latest_target = self._read_target(self._latest_known)
        with self._write_repo.lease("checkpoint"), explain_full_disk(self.tier):
            return self._write_leased(prepared)

    def _write_leased(self, prepared: PreparedSave) -> SaveResult:
        start = time.perf_counter()
        try:
            digest = self._save_step(self._write_repo, prepared)
            stats = self._write_repo.last_write
            self._write_history.append(prepared.records)
        except BaseException:
            # The records this save carried (all but its own) go with the next save or close.
            with self._records_lock:
                self._pending_records[:0] = prepared.records[:-1]
            raise
        return self._publish(prepared, digest, start, stats.logical_bytes, stats.new_bytes)

    def _save_step(self, repo: Repository, prepared: PreparedSave) -> Digest:
        """Save ``prepared`` to its step ref. The run owns its step refs, so it replaces one the
        policy protects: a run resumed from an earlier checkpoint saves the later steps again.
        That is said in a warning; what the ref named stays in its history (``cas log``)."""
        before = repo.find_ref(prepared.ref) if repo.ref_protection(prepared.ref) else None
        tree, ref, meta, trigger = prepared.tree, prepared.ref, prepared.meta, prepared.trigger
        digest = repo.save(tree, ref, meta, message=trigger, overwrite=True)
        if before is not None and before.target != digest:
            log.warning("re-saved step %d over %s, which named %s", prepared.step, ref,
                        before.target[:16])  # fmt: skip
        return digest

    def _publish(
        self, prepared: PreparedSave, digest: Digest, start: float, logical: int, new: int
    ) -> SaveResult:
        """Move ``latest`` and ``best`` to the committed ``digest``, then run the policy."""
        latest = self.latest_ref_of(prepared.phase)
        if latest != self._latest_known:  # a per-phase latest: another phase's pointer
            self._latest_target = self._read_target(latest)
        self._write_repo.set_ref(  # the run's own pointer: moving it is what it is for
            latest, digest, expected=self._latest_target, op="save",
            message=prepared.ref, overwrite=True,
        )  # fmt: skip
        self._latest_target, self._latest_known = digest, latest
        is_best = self._update_best(digest, prepared)
        mirror_error = self._mirror_best(prepared.phase, digest)
        retention_error: str | None = None
        damaged: tuple[str, ...] = ()
        if self.policy is not None:
            try:
                damaged = self._apply_policy()
            except Exception as e:  # e.g. a `cas gc` holds the maintenance lock right now
                retention_error = f"{type(e).__name__}: {e}"
                log.warning("saved %s; retention did not run: %s", prepared.ref, retention_error)
            if damaged:
                log.warning("saved %s; retention kept damaged refs %s", prepared.ref, damaged)
        self._retention_note = retention_note(prepared.step, retention_error, damaged)
        result = SaveResult(
            prepared.step,
            prepared.phase,
            prepared.ref,
            digest,
            prepared.trigger,
            prepared.status,
            is_best,
            prepared.blocking,
            time.perf_counter() - start,
            logical,
            new,
            retention_error,
            mirror_error,
            damaged,
            self.tier.notify(prepared.ref, prepared.meta["saved_at"], new, latest)
            if self.tier
            else None,
        )
        self._last_result = result
        return result

    def _apply_policy(self) -> tuple[str, ...]:
        """Run the policy; the damaged refs it kept (a RetentionPolicy's, which reports them)."""
        if isinstance(self.policy, RetentionPolicy):
            forget = self.tier.apply_local_policy if self.tier is not None else self.repo.forget
            return tuple(d.ref for d in forget(self.policy).damaged)
        apply = getattr(self.policy, "apply", None)
        (apply or self.policy)(self.repo)
        return ()

    def wait(self) -> None:
        """Wait for every save in flight; raise a background failure."""
        try:
            if self._writer is not None:
                self._writer.wait()
        finally:
            self._lender.reclaim(force=True)

    def close(self) -> None:
        """Finish saves in flight, write pending history records, remove the signal handlers."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            self._lender.reclaim(force=True)
            self.triggers.uninstall()
            if self._write_repo is not self.repo:
                self._write_repo.close()  # its threads only: the store is shared
            if self.tier is not None:  # a checkpoint a resume loaded from the remote, then history
                self.tier.settle()
            with self._records_lock:
                records, self._pending_records = self._pending_records, []
            if records:
                self.history.append(records)
            if self.tier is not None:
                self.tier.close(CLOSE_WAIT)  # what is left, the next run's drain pushes

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def restore(
        self,
        mode: str = "resume",
        *,
        source: str | None = None,
        keys: str | list[str] | None = None,
        template: Any = None,
        map_location: str | torch.device | None = None,
        allow_system_change: bool = False,
    ) -> Restored:
        """Start the run: ``fresh``, ``warm_start``, ``resume`` or ``auto`` (resume if possible).

        - ``fresh``: nothing is loaded; RNGs are seeded from ``seed`` and the phase (after your
          model drew its initial weights: seed those yourself, before building it).
        - ``warm_start``: weights from ``source`` (default: latest), RNGs seeded fresh, no config
          check; use it at a phase transition, with ``template`` for a strict key check.
        - ``resume``: the exact state, RNGs restored; the config hash must match. Without a
          ``source``, a latest checkpoint that fails verification is skipped for the one before
          it, with a warning and an entry in ``Restored.fallbacks``. The ``system_hash`` must
          match too, unless ``allow_system_change``.
        - ``pivot``: ``resume`` under a changed config (ANDREA's polish pivot): the exact state,
          RNGs and step go on; the history records the pivot and the config's changes.

        A checkpoint of an older ``schema_version`` is passed through ``migrations`` before it
        is returned; one of a newer version is refused (``SchemaMismatch``) in every mode.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.wait()
        self._latest_known = self.latest_ref
        newer = self.tier.newer() if self.tier and source is None and mode != "fresh" else None
        self._latest_target = newer.target if newer else self._read_target(self.latest_ref)
        if mode == "auto":
            mode = "resume" if source is not None or self._latest_target is not None else "fresh"
        if mode == "fresh":
            rng_mod.seed_all(rng_mod.phase_seed(self.seed, self.phase))
            return Restored("fresh", None, phase=self.phase)
        candidates: Iterable[tuple[str, Digest]]
        if source is not None:
            candidates = [(source, self.repo.resolve(source))]
        elif self._latest_target is None:
            raise NotFound(f"run {self.run} has no checkpoint to {mode.replace('_', ' ')} from")
        elif newer is not None:
            candidates = [(newer.ref, newer.target)]
        else:
            candidates = resume_candidates(self.repo, self.latest_ref)

        def check(ref: str, meta: Mapping[str, Any]) -> None:
            self.schema.check(ref, meta)
            if mode == "warm_start":
                return
            if mode == "resume":
                check_config(ref, meta, self.config_hash, self.config)
            if not allow_system_change:
                check_system(ref, meta, self.system_hash)

        def load(repo: Repository, candidates: Iterable[tuple[str, Digest]]) -> Found:
            return load_first_good(
                repo, candidates, keys=keys, map_location=map_location,
                with_rng=mode != "warm_start", check=check, fallback=source is None,
                heal=self.tier.heal if self.tier is not None else None,
            )  # fmt: skip

        tier = self.tier if newer else None
        found = tier.load_newer(newer, load) if tier and newer else load(self.repo, candidates)
        return self._restored(mode, found, template)

    def _restored(self, mode: str, found: Found, template: Any) -> Restored:
        state = self.schema.upgrade(found.ref, found.meta, unwrap(found.tree, found.meta))
        if template is not None:
            check_keys(state, template, found.ref)
        step = int(found.meta.get("step", 0))
        warnings: list[str] = []
        if mode in ("resume", "pivot"):
            if isinstance(found.tree, dict) and isinstance(found.tree.get("rng"), dict):
                warnings = rng_mod.restore(found.tree["rng"])
            elif self.capture_rng:
                warnings.append(f"{found.ref} holds no RNG state; RNGs were not restored")
            self.phase = int(found.meta.get("phase", self.phase))
        else:
            rng_mod.seed_all(rng_mod.phase_seed(self.seed, self.phase))
        with self._records_lock:
            self._pending_records.append(
                {
                    "step": step,
                    "event": mode,
                    "ref": found.ref,
                    "skipped": [s.ref for s in found.skipped],
                    **(config_change(found.meta, self.config) if mode == "pivot" else {}),
                }
            )
        return Restored(
            mode,
            state,
            step,
            int(found.meta.get("phase", self.phase)),
            found.ref,
            found.digest,
            dict(found.meta.get("metrics", {})),
            found.meta,
            found.skipped,
            warnings,
        )
