"""Demo: train a tiny model on CPU, checkpoint it into a local cas store, show what was stored.

A small character-level language model (a frozen "pretrained" embedding plus a trainable MLP head,
the shape of a fine-tune) trains for a few hundred steps on text from Python's own standard
library. Every 25 steps the full training state (weights, AdamW moments, scheduler, RNG) is saved
under a Hydra-style ref and a record of its loss goes into the run's history (`cas history RUN`);
the best checkpoint is copied to a gate, and a weights-only snapshot is
taken. At the end the demo prints the refs, what a reload gives back, and how much the store
deduplicated compared with writing every checkpoint as a file.

    python scripts/demo.py [--store DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import random
import time
from pathlib import Path

import torch

import cas
from cas.cli.app import human_bytes
from cas.training.history import TrainingHistory


def corpus() -> str:
    """Real text to learn: the source of a few standard-library modules."""
    import argparse as a
    import json as j
    import pathlib as p

    return "".join(inspect.getsource(m) for m in (a, j, p))


class TinyLM(torch.nn.Module):
    """Predict the next character from the previous eight: a frozen base and a trained head."""

    def __init__(self, vocab: int, context: int = 8, dim: int = 64, hidden: int = 1024) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.backbone = torch.nn.Linear(context * dim, hidden)
        for frozen in (*self.embed.parameters(), *self.backbone.parameters()):
            frozen.requires_grad_(False)  # the "pretrained base": its chunks dedup across saves
        self.head = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(hidden, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.backbone(self.embed(x).flatten(1)))
        return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="demo-store", help="store path [demo-store]")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    args = parser.parse_args()

    seed = 0xA1B2C3D4
    torch.manual_seed(seed)
    random.seed(seed)
    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    model = TinyLM(len(chars))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    repo = cas.open(args.store)
    run = f"runs/{dt.datetime.now(dt.timezone.utc):%Y%m%d_%H%M%S}_{seed:08x}"
    history = TrainingHistory(repo, f"{run}/history")  # what `cas history RUN` prints
    print(f"store {repo.url}\nrun   {run}\n")
    best = float("inf")
    saved_bytes = 0
    save_seconds = 0.0
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - 9, (64,))
        x = torch.stack([data[s : s + 8] for s in starts])
        y = data[starts + 8]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        torch.autograd.backward(loss)  # Tensor.backward has no annotations
        opt.step()
        sched.step()
        if step % args.every == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "rng_state": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "step": step,
            }
            ref = f"{run}/phase1/ckpt_phase1_step{step:08d}"
            t0 = time.perf_counter()
            repo.save(
                state, ref, metadata={"step": step, "phase": 1, "metrics": {"loss": loss.item()}}
            )
            repo.cp(ref, f"{run}/latest")
            history.append([{"step": step, "loss": loss.item(), "lr": sched.get_last_lr()[0],
                             "ref": ref}])  # fmt: skip
            if loss.item() < best:
                best = loss.item()
                # `best` is a protected pointer: moving it to a better checkpoint is explicit.
                repo.cp(ref, f"{run}/best", overwrite=True)
            save_seconds += time.perf_counter() - t0
            saved_bytes += repo.last_write.logical_bytes
            print(
                f"step {step:4d}  loss {loss.item():.3f}  saved {ref.rsplit('/', 1)[1]}  "
                f"{human_bytes(repo.last_write.logical_bytes)} logical, "
                f"{human_bytes(repo.last_write.new_bytes)} new"
            )
    repo.cp(f"{run}/best", f"{run}/gates/demo_best")
    repo.cp(f"{run}/latest", f"{run}/weights_only", only="model.*")

    restored = repo.load(f"{run}/latest")
    fresh = TinyLM(len(chars))
    fresh.load_state_dict(restored["model"], strict=True)
    same = all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )

    run_chunks = {d for r in repo.refs(run) for d in repo.manifest(r.target).chunk_digests()}
    stored = repo.stored_bytes(run_chunks)
    print(f"\nrefs under {run}:")
    for record in repo.refs(run):
        print(f"  {record.target[:12]}  {record.name}")
    print(f"\nreloaded latest: step {restored['step']}, weights bit-identical: {same}")
    print(f"checkpoints as files would take {human_bytes(saved_bytes)}")
    print(
        f"this run's chunks in the store:  {human_bytes(stored)} ({stored / saved_bytes:.0%} of that)"
    )
    print(f"time in save: {save_seconds:.2f} s for {args.steps // args.every} checkpoints")
    summary = {
        "run": run,
        "logical_bytes": saved_bytes,
        "stored_bytes": stored,
        "bit_identical": same,
    }
    Path(args.store, "demo-summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
