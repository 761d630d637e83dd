"""A run's named refs: where its checkpoints, ``latest``, ``best``, gates and pool live, and
what they name.

``RunRefs`` is the part of ``CheckpointManager`` that only reads and copies refs (no tensor is
written here), kept apart so the manager's save and resume logic reads on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cas.digest import Digest
from cas.repo.repository import Repository
from cas.training.compat import check_keys
from cas.training.restore import load_checkpoint, unwrap
from cas.training.run_names import Layout
from cas.training.schema import UserSchema

if TYPE_CHECKING:
    import torch

    from cas.training.pool import OpponentPool


class RunRefs:
    """Ref names and pointer reads of one run; mixed into ``CheckpointManager``."""

    repo: Repository
    run: str
    phase: int
    layout: Layout
    clock: Callable[[], float]
    schema: UserSchema

    def wait(self) -> None:
        """Wait for saves in flight (the manager's); pointers are read after them."""

    @property
    def latest_ref(self) -> str:
        """The ref naming the newest checkpoint of the run."""
        return self.layout.latest.format(run=self.run)

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
        checkpoint is replaced only with ``overwrite=True``; otherwise AlreadyExists.
        """
        self.wait()
        if source is None:
            source = self.best_ref if self._read_target(self.best_ref) else self.latest_ref
        return self.repo.cp(
            source, self.gate_ref(name), message=f"gate {name} from {source}", overwrite=overwrite
        )

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
