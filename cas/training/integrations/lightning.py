"""Lightning: a CheckpointIO plugin that saves, loads and removes checkpoints in a cas store.

``Trainer(plugins=[CASCheckpointIO(repo, prefix="runs/exp1")])`` routes every checkpoint Lightning
writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) to ``repo.save`` instead of
``torch.save``: the path's file name becomes a ref under ``prefix``
(``/ckpts/epoch=0-step=10.ckpt`` -> ``runs/exp1/epoch=0-step=10.ckpt``), tensors are chunked and
deduplicated, nothing is pickled, and ``<prefix>/latest`` follows the newest save. Loading
(``trainer.fit(ckpt_path=...)``) and removal (``save_top_k`` pruning) map paths to refs the same
way. With ``remote=`` (a Repository or URL) and ``remote_policy=``, every save also drains to
that remote tier in the background, as ``CheckpointManager(remote=...)`` does
(``cas.training.tiers``); ``teardown`` lets it catch up. A checkpoint value cas cannot store
without pickle (an arbitrary object in ``hyper_parameters``) is a ``FormatError`` naming its
path; keep hyperparameters plain.

``fit(ckpt_path="last")`` and re-runs. Lightning finds "last" by listing the checkpoint
callback's ``dirpath`` and then checking each candidate on the filesystem its path names. Neither
route survives that: with this plugin nothing is on the filesystem, and with
``ModelCheckpoint(dirpath="cas://...")`` fsspec lists paths without their protocol, which
Lightning then looks for on the local disk (a Lightning bug for every remote
filesystem, still in 2.6). Either way it warns
"there is no last checkpoint available" and trains from step 0. Importing this module therefore
wraps two Lightning methods, and the wrappers only act for a trainer whose checkpoints go to cas:
"last" is the newest ``last*.ckpt`` (or on-exception checkpoint) in the store, and, with this
plugin, ``ModelCheckpoint`` asks the store whether a file name is taken, so a re-run writes
``last-v1.ckpt`` and ``epoch=0-step=4-v1.ckpt`` as it would on local disk instead of replacing
the previous run's refs. Every other trainer runs Lightning's code unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import Callable
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.utilities import rank_zero_warn

from cas.errors import NotFound
from cas.retention.policy import RetentionPolicy
from cas.training.tiers import CLOSE_WAIT, RemoteTier

if TYPE_CHECKING:
    from cas.repo.repository import Repository

_UNSAFE = re.compile(r"[^A-Za-z0-9._@+=,-]")


class CASCheckpointIO(CheckpointIO):  # type: ignore[misc,unused-ignore]
    """Checkpoint paths are refs ``<prefix>/<file name>`` in ``repo``."""

    def __init__(
        self,
        repo: Repository,
        prefix: str = "runs/lightning",
        *,
        remote: Repository | str | None = None,
        remote_policy: RetentionPolicy | None = None,
        remote_queue: int = 8,
        remote_retry: float = 2.0,
    ) -> None:
        self.repo = repo
        self.prefix = prefix.rstrip("/")
        self.tier: RemoteTier | None = None
        """With ``remote``: the remote tier each save drains to (``cas.training.tiers``)."""
        if remote is not None:
            self.tier = RemoteTier(
                repo, remote, checkpoints=f"{self.prefix}/*.ckpt", latest=f"{self.prefix}/latest",
                policy=remote_policy, max_pending=remote_queue, retry=remote_retry,
                max_retry=max(60.0, remote_retry),
            )  # fmt: skip

    def ref_for(self, path: str | os.PathLike[str]) -> str:
        """The ref a checkpoint path is stored under."""
        name = _UNSAFE.sub("_", PurePath(os.fspath(path)).name) or "checkpoint"
        if not (name[0].isalnum() or name[0] == "_"):
            name = f"_{name}"
        return f"{self.prefix}/{name}"

    def saved_at(self, path: str | os.PathLike[str]) -> float | None:
        """When the checkpoint for ``path`` was last saved (seconds since the epoch), else None."""
        record = self.repo.find_ref(self.ref_for(path))
        return None if record is None else record.history[-1].time

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Store ``checkpoint`` under the ref of ``path``; then point ``latest`` at it.

        Lightning's ``last.ckpt`` (``last-v1.ckpt`` on a re-run) and ``latest`` are pointers it
        moves at every save, so they are replaced even where the stored policy protects them;
        any other checkpoint already stored under a protected ref is refused (ProtectedRef).
        """
        ref = self.ref_for(path)
        meta = {"source": "lightning", "path": os.fspath(path),
                "epoch": checkpoint.get("epoch"), "step": checkpoint.get("global_step")}  # fmt: skip
        pointer = _is_last(PurePath(os.fspath(path)).name)
        meta = {k: v for k, v in meta.items() if v is not None}
        digest = self.repo.save(checkpoint, ref, meta, overwrite=pointer)
        self.repo.set_ref(f"{self.prefix}/latest", digest, op="save", message=ref, overwrite=True)
        if self.tier is not None:
            self.tier.notify(ref, time.time(), self.repo.last_write.new_bytes)

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
        """Delete the ref of ``path`` (its chunks go when GC finds them unreferenced); with a
        remote tier, one the remote policy keeps is deleted once it has reached the remote."""
        ref = self.ref_for(path)
        if self.tier is not None and self.tier.remove_after_drain(ref):
            return
        with contextlib.suppress(NotFound):
            self.repo.rm(ref)

    def teardown(self) -> None:
        """Stop the remote tier's drain after letting it catch up (up to ``CLOSE_WAIT``)."""
        if self.tier is not None:
            self.tier.close(CLOSE_WAIT)


# -- Lightning's "last" and its file-exists check, answered from the store -------------------------


def _last_pattern(callback: ModelCheckpoint) -> re.Pattern[str]:
    """The file names Lightning counts as a callback's last checkpoint (``last.ckpt``,
    ``last-v1.ckpt``): as its own ``_find_last_checkpoints``, any whose stem starts with the
    last name and whose suffix is the checkpoint extension."""
    name, ext = re.escape(callback.CHECKPOINT_NAME_LAST or ""), re.escape(callback.FILE_EXTENSION)
    return re.compile(rf"^{name}.*{ext}$", re.DOTALL)


def _is_last(name: str) -> bool:
    """Whether a file name is one Lightning gives its ``last`` checkpoint (``last-v1.ckpt``...)."""
    last, ext = re.escape(ModelCheckpoint.CHECKPOINT_NAME_LAST or ""), re.escape(".ckpt")
    return bool(last) and re.fullmatch(rf"{last}(-v\d+)?{ext}", name) is not None


def _is_cas(fs: Any) -> bool:
    """Whether an fsspec filesystem is ``cas://`` (by protocol: this layer does not import cas.fs)."""
    protocol = getattr(fs, "protocol", ())
    return "cas" in ((protocol,) if isinstance(protocol, str) else protocol)


def _on_filesystem(path: str) -> float | None:
    """Lightning's own check of a candidate: its modification time where its path says it is."""
    fs = get_filesystem(path)
    return fs.modified(path).timestamp() if fs.exists(path) else None


def _last_candidates(trainer: Any) -> dict[str, float] | None:
    """Every "last" checkpoint of ``trainer`` with when it was saved; None if none goes to cas."""
    io = trainer.strategy.checkpoint_io
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    on_exception = [cb for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)]
    found: dict[str, float] = {}
    if isinstance(io, CASCheckpointIO):
        names = [record.name.rpartition("/")[2] for record in io.repo.refs(f"{io.prefix}/")]
        paths = [cb.ckpt_path for cb in on_exception]
        for cb in callbacks:
            pattern = _last_pattern(cb)
            paths += [os.path.join(cb.dirpath or "", n) for n in names if pattern.match(n)]
        for path in paths:
            if (saved := io.saved_at(path)) is not None:
                found[path] = saved
        return found
    in_cas = [cb for cb in callbacks if cb.dirpath and _is_cas(cb._fs)]
    if not in_cas:
        return None
    for cb in callbacks:
        if cb in in_cas:
            cb._fs.invalidate_cache()  # another process (or trainer) may have saved since
            if cb._fs.exists(cb.dirpath):
                pattern = _last_pattern(cb)
                for info in cb._fs.ls(cb.dirpath, detail=True):
                    if pattern.match(info["name"].rpartition("/")[2]) and "created" in info:
                        found[cb._fs.unstrip_protocol(info["name"])] = info["created"]
        else:
            for path in cb._find_last_checkpoints(trainer):
                if (saved := _on_filesystem(path)) is not None:
                    found[path] = saved
    for exception_cb in on_exception:
        if (saved := _on_filesystem(exception_cb.ckpt_path)) is not None:
            found[exception_cb.ckpt_path] = saved
    return found


def _resolve_last_from_store(parse: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(parse)
    def parse_ckpt_path(self: _CheckpointConnector, state_fn: Any, ckpt_path: Any,
                        *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        if ckpt_path != "last" or (found := _last_candidates(self.trainer)) is None:
            return parse(self, state_fn, ckpt_path, *args, **kwargs)
        if not found:
            rank_zero_warn(
                f'.{state_fn.value}(ckpt_path="last") is set, but there is no last checkpoint in '
                "the store. No checkpoint will be loaded. HINT: Set `ModelCheckpoint(..., "
                "save_last=True)`."
            )
            return None
        return max(found, key=lambda path: found[path])

    parse_ckpt_path.cas_wrapped = True  # type: ignore[attr-defined]
    return parse_ckpt_path


def _file_exists_in_store(exists: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(exists)
    def file_exists(self: ModelCheckpoint, filepath: Any, trainer: Any) -> bool:
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, CASCheckpointIO):
            return exists(self, filepath, trainer)
        taken = trainer.is_global_zero and io.saved_at(filepath) is not None
        return bool(trainer.strategy.reduce_boolean_decision(taken, all=False))

    file_exists.cas_wrapped = True  # type: ignore[attr-defined]
    return file_exists


if not getattr(_CheckpointConnector._parse_ckpt_path, "cas_wrapped", False):
    _CheckpointConnector._parse_ckpt_path = _resolve_last_from_store(  # type: ignore[method-assign]
        _CheckpointConnector._parse_ckpt_path
    )
if not getattr(ModelCheckpoint.file_exists, "cas_wrapped", False):
    ModelCheckpoint.file_exists = _file_exists_in_store(  # type: ignore[method-assign]
        ModelCheckpoint.file_exists
    )
