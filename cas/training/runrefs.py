"""A run's named refs: where its checkpoints, ``latest``, ``best``, gates and pool live, and
what they name.

``RunRefs`` is the part of ``CheckpointManager`` that reads, copies and moves refs (no tensor is
written here), kept apart so the manager's save and resume logic reads on its own.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cas.digest import Digest
from cas.errors import CASError
from cas.refs.records import RefRecord
from cas.refs.store import RefChange
from cas.repo.repository import Repository
from cas.training.compat import check_keys
from cas.training.restore import load_checkpoint, unwrap
from cas.training.run_names import Layout
from cas.training.saves import PreparedSave, beats_best
from cas.training.schema import UserSchema

if TYPE_CHECKING:
    import torch

    from cas.training.pool import OpponentPool
    from cas.training.tiers import RemoteTier

log = logging.getLogger("cas.training.manager")


def open_mirror(mirror: Repository | str | None) -> Repository | None:
    """The mirror store: a Repository as given, or one opened (created if new) from a URL."""
    if mirror is None or isinstance(mirror, Repository):
        return mirror
    from cas.repo.opening import open as open_store

    return open_store(mirror)


class RunRefs:
    """Ref names and pointer reads of one run; mixed into ``CheckpointManager``."""

    repo: Repository
    run: str
    phase: int
    layout: Layout
    clock: Callable[[], float]
    mirror: Repository | None = None
    """A second store (an S3 archive...) that gates and ``best`` are pushed to on promotion,
    so ``cas verify --full --repair-from`` there can heal them."""
    tier: RemoteTier | None = None
    """The remote tier (``cas.training.tiers``) every save drains to."""
    schema: UserSchema
    best: tuple[str, str] | None
    _write_repo: Repository
    _best_cache: tuple[Digest, float] | None

    def wait(self) -> None:
        """Wait for saves in flight (the manager's); pointers are read after them."""

    @property
    def latest_ref(self) -> str:
        """The ref naming the newest checkpoint of the run (of the current phase, for a
        per-phase ``Layout(latest="{run}/phase{phase}/latest")``)."""
        return self.latest_ref_of(self.phase)

    def latest_ref_of(self, phase: int) -> str:
        """The ``latest`` pointer a save in ``phase`` moves."""
        return self.layout.latest.format(run=self.run, phase=phase)

    @property
    def best_ref(self) -> str:
        """The ref naming the best checkpoint of the current phase."""
        return self.layout.best.format(run=self.run, phase=self.phase)

    def checkpoint_ref(self, step: int, phase: int | None = None) -> str:
        """The ref a save of ``step`` goes to."""
        return self.layout.checkpoint.format(run=self.run, phase=phase or self.phase, step=step)

    def _read_target(self, ref: str) -> Digest | None:
        record = self.repo.find_ref(ref)
        return record.target if record else None

    def latest(self) -> str | None:
        """The checkpoint ref ``latest`` names (None before the first save)."""
        self.wait()
        return self._ref_of(self.latest_ref)

    def best_checkpoint(self) -> str | None:
        """The checkpoint ref ``best`` names in the current phase (None if there is none)."""
        self.wait()
        return self._ref_of(self.best_ref)

    def _ref_of(self, pointer: str) -> str | None:
        record = self.repo.find_ref(pointer)
        if record is None:
            return None
        return record.history[-1].message or pointer

    def gate_ref(self, name: str) -> str:
        """The ref of this run's gate ``name`` (``runs/<id>/gates/<name>`` by default)."""
        return self.layout.gate.format(name=name, run=self.run, phase=self.phase)

    def promote_gate(
        self, name: str, source: str | None = None, *, overwrite: bool = False
    ) -> Digest:
        """Copy ``source`` (default: this phase's best, else latest) to the gate ``name``.

        A gate is a ref of its own (no chunk is written), so pruning checkpoints never removes
        it when the policy protects it (``runs/*/gates/*``). A gate that already names another
        checkpoint is replaced only with ``overwrite=True``; otherwise AlreadyExists. With a
        ``mirror`` store the gate is pushed there too; a failed push raises (the gate stands).
        """
        self.wait()
        if source is None:
            source = self.best_ref if self._read_target(self.best_ref) else self.latest_ref
        gate = self.gate_ref(name)
        digest = self.repo.cp(
            source, gate, message=f"gate {name} from {source}", overwrite=overwrite
        )
        try:
            self._mirror(gate)
        except CASError as e:
            raise type(e)(f"gate {gate} is promoted, but not mirrored: {e}") from e
        return digest

    def _mirror(self, ref: str) -> None:
        """Push ``ref`` (its missing chunks, then the ref) to the mirror store, if there is one;
        wake the remote tier's drain, which pushes it too."""
        if self.tier is not None:
            self.tier.wake()
        if self.mirror is not None:
            self.repo.push(self.mirror, [ref])

    def _mirror_best(self, phase: int, digest: Digest) -> str | None:
        """Push this phase's ``best`` to the mirror if it names ``digest`` (a save just became
        the best); why that failed, or None. A failed push does not fail the save."""
        best_ref = self.layout.best.format(run=self.run, phase=phase)
        if self.mirror is None or self._read_target(best_ref) != digest:
            return None
        try:
            self._mirror(best_ref)
        except CASError as e:
            log.warning("%s moved, but was not mirrored: %s", best_ref, e)
            return f"{type(e).__name__}: {e}"
        return None

    def _update_best(self, digest: Digest, prepared: PreparedSave) -> bool:
        """Move this phase's ``best`` to ``digest`` if its metric beats the current best's."""
        if self.best is None:
            return False
        key, mode = self.best
        value = prepared.meta["metrics"].get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            return False
        best_ref = self.layout.best.format(run=self.run, phase=prepared.phase)

        def better_of(current: RefRecord | None) -> Digest | RefChange:
            if current is not None:
                current_value = self._best_value(current.target, key)
                if current_value is not None and not beats_best(float(value), current_value, mode):
                    return RefChange.KEEP  # the best so far (perhaps another writer's) stands
            return digest

        # The manager's own metric comparison is what moves best: an explicit replacement.
        record = self._write_repo.update_ref(
            best_ref, better_of, op="best", message=prepared.ref, overwrite=True
        )
        if record is None or record.target != digest:
            return False
        self._best_cache = (digest, float(value))
        return True

    def _best_value(self, digest: Digest, key: str) -> float | None:
        if self._best_cache is not None and self._best_cache[0] == digest:
            return self._best_cache[1]
        value = self._write_repo.manifest(digest).meta.get("metrics", {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._best_cache = (digest, float(value))
            return float(value)
        return None

    def load_gate(
        self,
        name: str,
        *,
        keys: str | list[str] | None = None,
        template: Any = None,
        map_location: str | torch.device | None = None,
    ) -> Any:
        """Load a gate strictly: no fallback, and any key mismatch with ``template`` is an error.
        A gate of an older schema version is migrated first, a newer one refused."""
        gate = self.gate_ref(name)
        tree, meta = load_checkpoint(self.repo, gate, keys, map_location, with_rng=False)
        state = self.schema.upgrade(gate, meta, unwrap(tree, meta))
        if template is not None:
            check_keys(state, template, gate)
        return state

    def pool(self, capacity: int = 20) -> OpponentPool:
        """The opponent pool of this run's current phase."""
        from cas.training.pool import OpponentPool

        prefix = self.layout.pool.format(run=self.run, phase=self.phase)
        return OpponentPool(self.repo, prefix, capacity=capacity, clock=self.clock)
