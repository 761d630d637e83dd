"""A store for ``cas ui``'s tests: two runs with history, a gate, a pool, a policy, a remote tier
(``archive``, a second store that holds beta but not alpha) and markup in names and metadata.

Built with the real manager, pool and retention policy, so the pages show what a user's store
holds; ``HOSTILE_META`` (a metric name and a ref message) and ``HOSTILE_KEY`` (a ref key planted in
the store's directory) are markup, to check that every page shows them as text.
"""

from __future__ import annotations

from pathlib import Path

import torch

import cas
from cas.retention.policy import RetentionPolicy, Rule
from cas.training.manager import CheckpointManager
from cas.training.pool import OpponentPool

RUNS = ("runs/alpha", "runs/beta")
HOSTILE_META = '<script>alert("x")</script>'
HOSTILE_KEY = "<img src=x onerror=alert(1)>"
STEPS = 40
EVERY = 10


def loss_at(run: int, step: int) -> float:
    """A falling loss curve, different per run."""
    return 2.0 / (1 + 0.1 * step) + 0.05 * run


def build(path: Path) -> cas.Repository:
    """Two runs of ``STEPS`` steps saved every ``EVERY``; alpha has a gate and a pool, and a
    stored policy keeps the last 2 checkpoints of each run."""
    repo = cas.open(str(path))
    for i, run in enumerate(RUNS):
        torch.manual_seed(0)
        base = torch.nn.Embedding(64, 32)  # a frozen base both runs' checkpoints share
        torch.manual_seed(1 + i)
        head = torch.nn.Linear(32, 8)
        with CheckpointManager(
            repo, run=run, seed=i, every_n_steps=EVERY, best=("loss", "min"),
            signals=False, async_save=False,
        ) as mgr:  # fmt: skip
            for step in range(1, STEPS + 1):
                with torch.no_grad():
                    head.weight.add_(0.01)
                loss = loss_at(i, step)
                mgr.record(step, loss=loss, lr=1e-3 * (1 - step / (2 * STEPS)))
                state = {"model": {"base": base.state_dict(), "head": head.state_dict()}}
                mgr.step_end(step, state, metrics={"loss": loss, HOSTILE_META: 1.0})
            if i == 1:
                mgr.finish(STEPS, state, metrics={"loss": loss})
            else:
                mgr.promote_gate("bc_best")
                pool = OpponentPool(repo, f"{run}/phase1/opponent_pool", capacity=2)
                for version, mu in enumerate((20.0, 24.0, 27.5)):
                    pool.promote(
                        {"head": head.state_dict()},
                        {"mu": mu, "sigma": 3.0 - version, "games": 10 * version},
                        step=EVERY * (version + 1),
                        anchor=version == 0,
                    )
    repo.cp(f"{RUNS[0]}/latest", f"{RUNS[0]}/phase1/marked", message=HOSTILE_META)
    archive = cas.open(path.parent / f"{path.name}-archive")
    repo.push(archive, [f"{RUNS[1]}/**"])  # beta reached the remote tier; alpha did not
    archive.close()
    repo.update_config("remotes", {"archive": {"url": str(path.parent / f"{path.name}-archive")}})
    repo.store_retention_policy(
        RetentionPolicy(
            rules=(Rule(select="runs/*/phase*/ckpt_*", group_by=2, keep_last=2),),
            protect=("runs/*/gates/*",),
        )
    )
    return repo
