"""One resume in a process of its own, for ``scripts/bench_tiers.py``: what a job landing on a
new node does from the interpreter's start to its first training step.

    python scripts/resume_child.py cas SIZE STORE URL      # CheckpointManager(remote=URL)
    python scripts/resume_child.py boto3 SIZE BUCKET KEY   # boto3 GET of one .pt + torch.load

Both build the same model (``gpt_model``), import only what their way of resuming needs, and
print ``stepped`` once the first step is done; the parent's clock runs from starting this
process to reading that line. After the word come two ``time.perf_counter()`` readings (the
system's monotonic clock, the parent's too): when the model was built, and when the first step
was done. Up to the first, both children do the same work (the interpreter, torch, the model),
so the second minus the first is what the way of resuming itself costs, imports and S3 client
included. S3's endpoint and keys come from the environment.
"""

from __future__ import annotations

import sys
import time

import torch
from gpt_model import SIZES, Loop


def main(argv: list[str]) -> int:
    mode, size, where, what = argv
    loop = Loop(SIZES[size], frozen_backbone=True)
    built = time.perf_counter()
    if mode == "cas":
        import cas
        from cas.training.manager import CheckpointManager

        with CheckpointManager(cas.open(where), run="ft", signals=False, remote=what) as mgr:
            state = mgr.restore("auto").state
            loop.model.load_state_dict(state["model"])
            loop.opt.load_state_dict(state["optimizer"])
            loop.step()
            print(f"stepped {built:.6f} {time.perf_counter():.6f}", flush=True)
        return 0
    import io

    import boto3

    buffer = io.BytesIO()
    boto3.client("s3").download_fileobj(where, what, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    loop.model.load_state_dict(state["model"])
    loop.opt.load_state_dict(state["optimizer"])
    loop.step()
    print(f"stepped {built:.6f} {time.perf_counter():.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
