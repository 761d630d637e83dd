"""Hugging Face ``transformers``: a TrainerCallback that stores every ``checkpoint-N/`` in cas.

After the Trainer writes ``<output_dir>/checkpoint-N/`` it calls ``on_save``; the callback ingests
the directory with ``repo.put_path`` under ``<prefix>/ckpt_step<08d>`` and moves ``<prefix>/latest``
by compare-and-swap. What the Trainer logged at that step (``eval_loss`` after an evaluation,
``loss``...) is stored in the manifest's ``meta["metrics"]``, where a retention policy's
``keep_best`` reads it. The safetensors weights and the ``torch.save`` optimizer/scheduler files are cut
at tensor boundaries, so unchanged tensors dedup across checkpoints and with tensors saved through
``repo.save``. ``training_args.bin`` is a pickled ``TrainingArguments`` (not weights-only), so it is
stored as opaque bytes (``allow_opaque_pickles=True``) and never unpickled by cas.

With ``async_ingest=True`` the ingest runs on a background thread; the callback waits for it
before the Trainer's next save (which may rotate old directories away) and at the end of training.

With ``keep_local=False`` the store replaces the local directories: each ``checkpoint-N/`` is
deleted once it is stored (on the training thread, before the Trainer's next save, so never
while the Trainer lists or rotates them). The one directory the Trainer still reads is kept
until it has: with ``load_best_model_at_end`` the best checkpoint stays until training ends
(the Trainer loads it just before ``on_train_end``), or until a better one replaces it.

Resuming from a ref is one line:
``trainer.train(resume_from_checkpoint=resume_dir(repo, "runs/exp/latest", args.output_dir))``.
The Trainer reads a checkpoint only from a local directory (``os.path.isfile`` on each file, not
fsspec), so ``resume_dir`` writes the stored checkpoint back as ``<output_dir>/checkpoint-N/``;
with ``keep_local=False`` that directory is deleted again once the Trainer has read it (after the
first step: RNG states are read then).

With ``remote=`` (a Repository or URL) and ``remote_policy=``, each stored checkpoint also drains
to that remote tier in the background (``cas.training.tiers``, as ``CheckpointManager(remote=...)``);
``on_train_end`` lets it catch up.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from cas.digest import Digest
from cas.retention.policy import RetentionPolicy
from cas.training.async_save import AsyncWriter
from cas.training.tiers import CLOSE_WAIT, RemoteTier

if TYPE_CHECKING:
    from cas.repo.repository import Repository

PREFIX_CHECKPOINT_DIR = "checkpoint"


def _metrics_at(state: TrainerState, step: int) -> dict[str, float]:
    """The numbers the Trainer logged at ``step`` (``eval_loss``, ``loss``...), so a retention
    policy's ``keep_best("eval_loss")`` can rank the checkpoint; eval values win over training
    values of the same step."""
    out: dict[str, float] = {}
    for entry in state.log_history:
        if entry.get("step") != step:
            continue
        for key, value in entry.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                out[key] = float(value)
    return out


class CASCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Ingests each ``checkpoint-N/`` into ``repo`` under ``prefix`` (default ``runs/<output_dir name>``)."""

    def __init__(
        self,
        repo: Repository,
        prefix: str | None = None,
        *,
        async_ingest: bool = False,
        keep_local: bool = True,
        remote: Repository | str | None = None,
        remote_policy: RetentionPolicy | None = None,
        remote_queue: int = 8,
        remote_retry: float = 2.0,
    ) -> None:
        self.repo = repo
        self.remote = remote
        self.remote_policy = remote_policy
        self.remote_queue = remote_queue
        self.remote_retry = remote_retry
        """Seconds before a failed drain is tried again, doubled per failure (to 60 s, or this
        if longer), as ``CheckpointManager(remote_retry=)``."""
        self.tier: RemoteTier | None = None
        """With ``remote``: the remote tier each checkpoint drains to, from the first save on."""
        self.prefix = prefix
        self.keep_local = keep_local
        self.stored: list[tuple[int, str, Digest]] = []
        self._writer: AsyncWriter[Digest] | None = AsyncWriter(1) if async_ingest else None
        self._stored_dirs: list[str] = []
        """Directories stored since the last clean-up (appended by the ingest, maybe on the
        writer thread; emptied on the training thread)."""
        self._kept_best: str | None = None
        self._resumed_from: str | None = None

    def _prefix(self, args: TrainingArguments) -> str:
        return self.prefix or f"runs/{Path(str(args.output_dir)).name}"

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Store the checkpoint directory the Trainer has just written."""
        if not state.is_world_process_zero:
            return
        step = int(state.global_step)
        directory = os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{step}")
        prefix = self._prefix(args)
        ref = f"{prefix}/ckpt_step{step:08d}"
        meta = {"step": step, "epoch": state.epoch, "source": "transformers",
                "best_metric": state.best_metric, "metrics": _metrics_at(state, step)}  # fmt: skip
        tier = self._tier(prefix)

        def ingest(_: None) -> Digest:
            # The run owns its step refs and latest: a Trainer resumed from an earlier
            # checkpoint saves the later steps again, replacing them even where protected.
            digest = self.repo.put_path(
                directory, ref, meta, allow_opaque_pickles=True, overwrite=True
            )
            self.repo.set_ref(f"{prefix}/latest", digest, op="save", message=ref, overwrite=True)
            if tier is not None:
                tier.notify(ref, time.time(), self.repo.last_write.new_bytes)
            self.stored.append((step, ref, digest))
            self._stored_dirs.append(directory)
            return digest

        if self._writer is None:
            ingest(None)
            self._remove_stored(args, state)
        else:
            self._writer.submit(lambda: None, ingest)

    def _tier(self, prefix: str) -> RemoteTier | None:
        """The remote tier of ``prefix``, started at the first save (the prefix needs ``args``)."""
        if self.tier is None and self.remote is not None:
            self.tier = RemoteTier(
                self.repo, self.remote, checkpoints=f"{prefix}/ckpt_step*",
                latest=f"{prefix}/latest", policy=self.remote_policy,
                max_pending=self.remote_queue, retry=self.remote_retry,
                max_retry=max(60.0, self.remote_retry),
            )  # fmt: skip
        return self.tier

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Note the directory a resumed run reads its start from, to delete it once read."""
        directory = os.path.join(
            str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        )
        if not self.keep_local and state.global_step > 0 and os.path.isdir(directory):
            self._resumed_from = directory

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Before a save (which may delete old directories), finish the previous ingest."""
        if self._resumed_from is not None and state.is_world_process_zero:
            shutil.rmtree(self._resumed_from, ignore_errors=True)
            self._resumed_from = None
        if control.should_save:
            self.wait()
            self._remove_stored(args, state)

    def on_epoch_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Finish the previous ingest: ``save_strategy="epoch"`` decides to save here, and
        ``"best"`` right after evaluating (``on_evaluate``), with no callback in between."""
        self.wait()
        self._remove_stored(args, state)

    on_evaluate = on_epoch_end

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Finish every ingest in flight; without local copies, delete the best one too (the
        Trainer has loaded it by now)."""
        self.wait()
        self._remove_stored(args, state, ending=True)
        if self.tier is not None:
            self.tier.close(CLOSE_WAIT)  # what is left, the next run's drain pushes
            self.tier = None

    def _remove_stored(
        self, args: TrainingArguments, state: TrainerState, *, ending: bool = False
    ) -> None:
        """With ``keep_local=False``, delete the stored directories the Trainer no longer needs."""
        if self.keep_local or not state.is_world_process_zero:
            return
        best = state.best_model_checkpoint if args.load_best_model_at_end and not ending else None
        done, self._stored_dirs = self._stored_dirs, []
        if self._kept_best is not None:
            done.append(self._kept_best)
            self._kept_best = None
        for directory in done:
            if best is not None and os.path.abspath(directory) == os.path.abspath(best):
                self._kept_best = directory
            else:
                shutil.rmtree(directory, ignore_errors=True)

    def wait(self) -> None:
        """Wait for background ingests; raise a failure."""
        if self._writer is not None:
            self._writer.wait()


def restore_checkpoint(repo: Repository, ref: str, output_dir: str | os.PathLike[str]) -> Path:
    """Write a stored ``checkpoint-N/`` back under ``output_dir``; return its path."""
    step = int(repo.manifest(ref).meta.get("step", 0))
    target = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    repo.get_path(ref, target, overwrite=True)
    return target


def resume_dir(repo: Repository, ref: str, output_dir: str | os.PathLike[str]) -> str:
    """The checkpoint ``ref`` as a directory for ``trainer.train(resume_from_checkpoint=...)``:
    written back as ``<output_dir>/checkpoint-N/`` (pass ``args.output_dir``)."""
    return str(restore_checkpoint(repo, ref, output_dir))
