"""Lightning: a CheckpointIO plugin that saves, loads and removes checkpoints in a cas store.

``Trainer(plugins=[CASCheckpointIO(repo, prefix="runs/exp1")])`` routes every checkpoint Lightning
writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) to ``repo.save`` instead of
``torch.save``: the path's file name becomes a ref under ``prefix``
(``/ckpts/epoch=0-step=10.ckpt`` -> ``runs/exp1/epoch=0-step=10.ckpt``), tensors are chunked and
deduplicated, nothing is pickled, and ``<prefix>/latest`` follows the newest save. Loading
(``trainer.fit(ckpt_path=...)``) and removal (``save_top_k`` pruning) map paths to refs the same
way. A checkpoint value cas cannot store without pickle (an arbitrary object in
``hyper_parameters``) is a ``FormatError`` naming its path; keep hyperparameters plain.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from cas.errors import NotFound

if TYPE_CHECKING:
    from cas.repo.repository import Repository

_UNSAFE = re.compile(r"[^A-Za-z0-9._@+=,-]")


class CASCheckpointIO(CheckpointIO):  # type: ignore[misc,unused-ignore]
    """Checkpoint paths are refs ``<prefix>/<file name>`` in ``repo``."""

    def __init__(self, repo: Repository, prefix: str = "runs/lightning") -> None:
        self.repo = repo
        self.prefix = prefix.rstrip("/")

    def ref_for(self, path: str | os.PathLike[str]) -> str:
        """The ref a checkpoint path is stored under."""
        name = _UNSAFE.sub("_", PurePath(os.fspath(path)).name) or "checkpoint"
        if not (name[0].isalnum() or name[0] == "_"):
            name = f"_{name}"
        return f"{self.prefix}/{name}"

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Store ``checkpoint`` under the ref of ``path``; then point ``latest`` at it."""
        ref = self.ref_for(path)
        meta = {"source": "lightning", "path": os.fspath(path),
                "epoch": checkpoint.get("epoch"), "step": checkpoint.get("global_step")}  # fmt: skip
        digest = self.repo.save(checkpoint, ref, {k: v for k, v in meta.items() if v is not None})
        self.repo.set_ref(f"{self.prefix}/latest", digest, op="save", message=ref)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load the checkpoint stored for ``path`` (verified; no pickle, so always weights-only)."""
        import torch

        location = map_location if isinstance(map_location, (str, torch.device)) else None
        try:
            loaded: dict[str, Any] = self.repo.load(self.ref_for(path), map_location=location)
        except NotFound as e:
            raise FileNotFoundError(f"checkpoint {path} is not in {self.repo.url}: {e}") from e
        return loaded

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the ref of ``path`` (its chunks go when GC finds them unreferenced)."""
        with contextlib.suppress(NotFound):
            self.repo.rm(self.ref_for(path))
