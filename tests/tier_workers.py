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
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import cas
from cas.repo.config import StoreConfig
from cas.retention.policy import RetentionPolicy, Rule

if TYPE_CHECKING:
    import torch

CONFIG = StoreConfig(chunk_size=16 << 10, inline_max=64)
EVERY_FOURTH = "runs/*/phase*/ckpt_*[048]"
"""Steps ending in 0, 4 or 8: what the remote keeps for good (an "every Nth step" by glob)."""
LOCAL_POLICY = RetentionPolicy(rules=(Rule("runs/*/phase*/ckpt_*", keep_last=2),))
REMOTE_POLICY = RetentionPolicy(
    rules=(Rule("runs/*/phase*/ckpt_*", keep_last=3, protect=(EVERY_FOURTH,)),)
)


def weights(step: int) -> dict[str, torch.Tensor]:
    """The state saved at ``step``: a frozen backbone and a head that changes every step."""
    import torch  # here, not at the top: the drain workers this module runs never import it

    head = torch.randn(8192, generator=torch.Generator().manual_seed(step))
    return {"backbone": torch.ones(32768), "head": head}


def kill_at_request(n: int, parent: bool = False) -> None:
    """SIGKILL this process (and first its parent, with ``parent``: a drain worker's training
    process, as when the node is lost) when it makes its ``n``-th S3 request (counting from 0)."""
    from botocore.client import BaseClient

    calls = itertools.count()
    lock = threading.Lock()
    original = BaseClient._make_api_call

    def counted(self: Any, operation: str, params: Any) -> Any:
        with lock:
            index = next(calls)
        if index == n:
            if parent:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, operation, params)

    BaseClient._make_api_call = counted


def train_until_killed(local: str, remote: str, run: str, kill_at: int, mode: str) -> None:
    """Resume (either tier), then save every step with the remote tier on, until the
    ``kill_at``-th S3 request of the drain kills the process: ``mode`` ``thread``, a request
    of this process; ``process``, one of its drain worker, which kills both."""
    from cas.training import drain_worker
    from cas.training.manager import CheckpointManager

    os.environ[drain_worker.ENV_MODE] = mode
    if mode == "thread":
        kill_at_request(kill_at)
    else:
        drain_worker.COMMAND = [sys.executable, "-m", "tests.tier_workers", str(kill_at)]
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


if __name__ == "__main__":  # a drain worker that kills itself and its parent at a request
    from cas.training.drain_worker import main

    kill_at_request(int(sys.argv[1]), parent=True)
    sys.exit(main(sys.argv[2:]))
