"""Hugging Face ``transformers``: a TrainerCallback that stores every ``checkpoint-N/`` in cas.

After the Trainer writes ``<output_dir>/checkpoint-N/`` it calls ``on_save``; the callback ingests
the directory with ``repo.put_path`` under ``<prefix>/ckpt_step<08d>`` and moves ``<prefix>/latest``
by compare-and-swap. The safetensors weights and the ``torch.save`` optimizer/scheduler files are cut
at tensor boundaries, so unchanged tensors dedup across checkpoints and with tensors saved through
``repo.save``. ``training_args.bin`` is a pickled ``TrainingArguments`` (not weights-only), so it is
stored as opaque bytes (``allow_opaque_pickles=True``) and never unpickled by cas.

With ``async_ingest=True`` the ingest runs on a background thread; the callback waits for it
before the Trainer's next save (which may rotate old directories away) and at the end of training.
``restore_checkpoint`` writes a stored checkpoint back as a directory for
``trainer.train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from cas.digest import Digest
from cas.training.async_save import AsyncWriter

if TYPE_CHECKING:
    from cas.repo.repository import Repository

PREFIX_CHECKPOINT_DIR = "checkpoint"


class CASCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Ingests each ``checkpoint-N/`` into ``repo`` under ``prefix`` (default ``runs/<output_dir name>``)."""

    def __init__(
        self, repo: Repository, prefix: str | None = None, *, async_ingest: bool = False
    ) -> None:
        self.repo = repo
        self.prefix = prefix
        self.stored: list[tuple[int, str, Digest]] = []
        self._writer: AsyncWriter[Digest] | None = AsyncWriter(1) if async_ingest else None

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
                "best_metric": state.best_metric}  # fmt: skip

        def ingest(_: None) -> Digest:
            digest = self.repo.put_path(directory, ref, meta, allow_opaque_pickles=True)
            self.repo.set_ref(f"{prefix}/latest", digest, op="save", message=ref)
            self.stored.append((step, ref, digest))
            return digest

        if self._writer is None:
            ingest(None)
        else:
            self._writer.submit(lambda: None, ingest)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Before a save (which may delete old directories), finish the previous ingest."""
        if control.should_save:
            self.wait()

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

    on_evaluate = on_epoch_end

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Finish every ingest in flight."""
        self.wait()

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
