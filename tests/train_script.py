"""A small training run driven by CheckpointManager, for the subprocess tests in test_signals.py.

It draws from every global RNG a real loop uses (torch for data and dropout, numpy for noise,
Python's random for augmentation choices), steps an AdamW optimizer and a StepLR schedule, and
prints ``step N`` after each step so a parent can signal it at a known point. ``--slow-after S``
makes chunk writes of saves after step S crawl, so a parent can SIGKILL it mid-save.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import cas
from cas.blobstore import LocalBlobStore, Payload
from cas.repo.config import read_config
from cas.training.manager import CheckpointManager

CONFIG = {"lr": 3e-3, "width": 32, "batch": 16, "dropout": 0.1}


class SlowChunkStore(LocalBlobStore):
    """A local store whose chunk writes sleep once ``armed`` is set."""

    armed = threading.Event()

    def __init__(self, root: str | Path, delay: float) -> None:
        super().__init__(root)
        self.delay = delay

    def put_if_absent(self, key: str, data: Payload) -> bool:
        if self.armed.is_set() and key.startswith("chunks/"):
            time.sleep(self.delay)
        return super().put_if_absent(key, data)


def build(width: int, dropout: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width * 2),
        torch.nn.Dropout(dropout),
        torch.nn.GELU(),
        torch.nn.Linear(width * 2, 4),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    return model, opt, sched


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=CONFIG["lr"])
    parser.add_argument("--slow-after", type=int, default=-1)
    parser.add_argument("--slow-delay", type=float, default=5.0)
    parser.add_argument("--sync", action="store_true", help="synchronous saves")
    args = parser.parse_args(argv)

    config = {**CONFIG, "lr": args.lr}
    if args.slow_after >= 0:
        cas.open(args.store).close()
        store_config = read_config(LocalBlobStore(args.store))
        assert store_config is not None
        repo = cas.Repository(SlowChunkStore(args.store, args.slow_delay), store_config)
    else:
        repo = cas.open(args.store)
    model, opt, sched = build(int(CONFIG["width"]), float(CONFIG["dropout"]))
    mgr = CheckpointManager(
        repo, run=args.run, seed=99, every_n_steps=args.every, best=("loss", "min"),
        config=config, async_save=not args.sync,
    )  # fmt: skip
    restored = mgr.restore("auto")
    start = 1
    if restored.state is not None:
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["optimizer"])
        sched.load_state_dict(restored.state["scheduler"])
        start = restored.step + 1
        print(f"resumed {restored.step} from {restored.ref}", flush=True)
        for skipped in restored.fallbacks:
            print(f"skipped {skipped.ref}", flush=True)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict()}  # fmt: skip

    for step in range(start, args.steps + 1):
        x = torch.randn(int(CONFIG["batch"]), int(CONFIG["width"]))
        x = x + float(np.random.normal(scale=0.1))
        if random.random() < 0.5:
            x = x.flip(0)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        mgr.record(step, loss=loss.item())
        print(f"step {step}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
        pending = mgr.step_end(step, state, {"loss": loss.item()})
        if pending is not None:
            print(f"saving {step}", flush=True)
            if step == args.slow_after:
                pending.result()
                SlowChunkStore.armed.set()
    mgr.finish(args.steps, state, {"loss": loss.item()})
    mgr.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
