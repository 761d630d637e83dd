"""A writer that saves checkpoints in a loop until it is killed (for the crash-safety test)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import cas
from cas.repo.config import StoreConfig


def expected_state(step: int) -> dict[str, torch.Tensor]:
    """The state saved at ``step``: every tensor is a deterministic function of the step."""
    gen = torch.Generator().manual_seed(1234)
    base = torch.randn(96, 1024, generator=gen)
    return {
        "frozen": base,
        "moving": base * step,
        "step_tensor": torch.full((5000,), float(step)),
        "bf16": (base[:16] + step).bfloat16(),
    }


def write_forever(store: str, start_step: int) -> None:
    """Save ``runs/crash/latest`` (and a per-step ref) for ever-increasing steps."""
    repo = cas.open(store, config=StoreConfig(chunk_size=16 << 10, inline_max=64))
    step = start_step
    while True:
        state = expected_state(step)
        repo.save(state, f"runs/crash/step{step:08d}", metadata={"step": step})
        repo.save(state, "runs/crash/latest", metadata={"step": step})
        step += 1


if __name__ == "__main__":
    write_forever(sys.argv[1], int(sys.argv[2]))
    Path(sys.argv[1]).touch()
