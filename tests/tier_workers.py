"""A training run with a remote tier that saves every step until it kills itself.

``tests/test_tiers_faults.py`` starts one per kill point: it SIGKILLs itself at its N-th request
to S3 (mid-drain: a chunk copy, the manifest, the checkpoint ref, ``latest``, the remote policy's
forget...), so the kill points cover the drain whatever the machine's speed. The next run
resumes from the newest checkpoint either tier holds and finishes the drain its predecessor left.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from typing import Any

import torch

import cas
from cas.repo.config import StoreConfig
from cas.retention.policy import RetentionPolicy, Rule

CONFIG = StoreConfig(chunk_size=16 << 10, inline_max=64)
EVERY_FOURTH = "runs/*/phase*/ckpt_*[048]"
"""Steps ending in 0, 4 or 8: what the remote keeps for good (an "every Nth step" by glob)."""
LOCAL_POLICY = RetentionPolicy(rules=(Rule("runs/*/phase*/ckpt_*", keep_last=2),))
REMOTE_POLICY = RetentionPolicy(
    rules=(Rule("runs/*/phase*/ckpt_*", keep_last=3, protect=(EVERY_FOURTH,)),)
)


def weights(step: int) -> dict[str, torch.Tensor]:
    """The state saved at ``step``: a frozen backbone and a head that changes every step."""
    head = torch.randn(8192, generator=torch.Generator().manual_seed(step))
    return {"backbone": torch.ones(32768), "head": head}


def kill_at_request(n: int) -> None:
    """SIGKILL this process when it makes its ``n``-th S3 request (counting from 0)."""
    from botocore.client import BaseClient

    calls = itertools.count()
    lock = threading.Lock()
    original = BaseClient._make_api_call

    def counted(self: Any, operation: str, params: Any) -> Any:
        with lock:
            index = next(calls)
        if index == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, operation, params)

    BaseClient._make_api_call = counted


def train_until_killed(local: str, remote: str, run: str, kill_at: int) -> None:
    """Resume (either tier), then save every step with the remote tier on, until the
    ``kill_at``-th S3 request kills the process."""
    from cas.training.manager import CheckpointManager

    kill_at_request(kill_at)
    repo = cas.open(local, config=CONFIG, fsync=False)  # SIGKILL loses no written page
    manager = CheckpointManager(
        repo, run=run, signals=False, policy=LOCAL_POLICY, remote=remote,
        remote_policy=REMOTE_POLICY, remote_queue=4,
    )  # fmt: skip
    restored = manager.restore("auto")
    step = restored.step + 1
    while True:
        manager.save(step, weights(step)).result()
        time.sleep(0.1)  # a training step: the drain gets a share of the machine
        step += 1
