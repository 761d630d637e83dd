"""Soak: saves, pushes and ``gc --grace 0`` on a real SeaweedFS while a share of S3 replies is lost.

Every request goes through ``cas.testing.lossy_proxy.LossyProxy``, which lets the server carry
it out and then, for ``--loss`` of them (seeded), closes the connection unanswered or answers
500: the write landed, its reply did not. Each round runs at once ``--savers`` writers (two saves
each, to refs of their own), one pusher (a local store pushing a new checkpoint to an existing
ref and to a new one) and one GC with no grace and no reflog window; refs two rounds old are
removed first, so GC has garbage to delete. After each round, read straight from the server:

- ``saves_lost``: a save that reported success whose ref no longer names its checkpoint, or
  whose checkpoint no longer verifies (a chunk or manifest gone);
- ``duplicate_events``: extra history events, beyond the one each save and push records;
- ``push_misreports``: a push whose report disagrees with the ref (failure reported although the
  ref moved, or success although it did not);
- ``gc_completed``: rounds whose GC ran to the end (a ``LockHeld`` naming itself is a failure).

Prints the figures as JSON. ``python scripts/soak_lossy_s3.py --rounds 20``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cas  # noqa: E402
from cas.digest import Digest  # noqa: E402
from cas.repo.config import StoreConfig  # noqa: E402
from cas.retention.gc import GCSettings  # noqa: E402
from cas.testing.lossy_proxy import LossRule, LossyProxy  # noqa: E402
from cas.testing.seaweed import (  # noqa: E402
    DUMMY_ACCESS_KEY,
    DUMMY_SECRET_KEY,
    REGION,
    SeaweedServer,
)

BUCKET = "soak"
CONFIG = StoreConfig(chunk_size=16 << 10, inline_max=64)
NO_GRACE = GCSettings(grace=0, reflog_window=0)
SAVES_PER_SAVER = 2


@dataclass
class Tally:
    """What the rounds did and found, summed."""

    saves: int = 0
    saves_failed: int = 0
    saves_lost: int = 0
    duplicate_events: int = 0
    pushes: int = 0
    pushes_failed: int = 0
    push_misreports: int = 0
    gc_completed: int = 0
    chunks_deleted: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, where: str, error: BaseException) -> None:
        """Count one failure by where and type (the figures name the kinds seen)."""
        key = f"{where}: {type(error).__name__}: {str(error)[:160]}"
        with self.lock:
            self.errors[key] = self.errors.get(key, 0) + 1


def checkpoint(seed: int) -> dict[str, Any]:
    """A small model state of a few chunks."""
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(96, 128, generator=generator), "b": torch.randn(128), "seed": seed}


def run(
    rounds: int = 20,
    loss: float = 0.05,
    seed: int = 0,
    savers: int = 3,
    *,
    mode: str = "both",
    server: SeaweedServer | None = None,
    url: str | None = None,
    work: Path | None = None,
) -> dict[str, Any]:
    """Run the soak; return the figures. Starts a SeaweedFS of its own unless given ``server``
    (then ``url`` names a fresh ``s3://`` prefix on it, with credentials in the environment)."""
    scratch = Path(tempfile.mkdtemp(prefix="cas-soak-", dir=work))
    try:
        if server is not None:
            return _soak(server, url or f"s3://{BUCKET}/{uuid.uuid4().hex}", scratch, rounds,
                         loss, seed, savers, mode)  # fmt: skip
        os.environ.update(
            AWS_ACCESS_KEY_ID=DUMMY_ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=DUMMY_SECRET_KEY,
            AWS_DEFAULT_REGION=REGION,
        )
        with SeaweedServer(scratch / "seaweed") as own:
            own.make_bucket(BUCKET)
            return _soak(own, f"s3://{BUCKET}/{uuid.uuid4().hex}", scratch, rounds, loss, seed,
                         savers, mode)  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _soak(
    server: SeaweedServer,
    url: str,
    scratch: Path,
    rounds: int,
    loss: float,
    seed: int,
    savers: int,
    mode: str,
) -> dict[str, Any]:
    began = time.monotonic()
    tally = Tally()
    rng = random.Random(seed)
    with LossyProxy(server.endpoint_url) as proxy:
        # Opened before replies are lost: opening probes the server, outside the retry layer.
        direct = cas.open(url, config=CONFIG, endpoint_url=server.endpoint_url)
        writers = [cas.open(url, endpoint_url=proxy.url) for _ in range(savers)]
        gc_repo = cas.open(url, endpoint_url=proxy.url)
        pushed_to = cas.open(url, endpoint_url=proxy.url)
        local = cas.open(scratch / "local", config=CONFIG)
        proxy.set_rule(LossRule(fraction=loss, seed=seed, mode=mode))
        for number in range(rounds):
            _round(number, rng, direct, writers, gc_repo, pushed_to, local, tally)
        replies_lost, requests = len(proxy.lost), proxy.forwarded
    return {
        "rounds": rounds,
        "loss": loss,
        "seed": seed,
        "savers": savers,
        "requests": requests,
        "replies_lost": replies_lost,
        "saves": tally.saves,
        "saves_failed": tally.saves_failed,
        "saves_lost": tally.saves_lost,
        "duplicate_events": tally.duplicate_events,
        "pushes": tally.pushes,
        "pushes_failed": tally.pushes_failed,
        "push_misreports": tally.push_misreports,
        "gc_completed": tally.gc_completed,
        "chunks_deleted": tally.chunks_deleted,
        "errors": tally.errors,
        "seconds": round(time.monotonic() - began, 1),
    }


def _round(
    number: int,
    rng: random.Random,
    direct: cas.Repository,
    writers: list[cas.Repository],
    gc_repo: cas.Repository,
    pushed_to: cas.Repository,
    local: cas.Repository,
    tally: Tally,
) -> None:
    for name in direct.ref_names(f"runs/r{number - 2:04d}/"):
        direct.rm(name)  # garbage for this round's GC
    saved: dict[str, Digest] = {}
    pushed: dict[str, tuple[Digest, bool]] = {}

    def save(index: int, repo: cas.Repository) -> None:
        for step in range(SAVES_PER_SAVER):
            ref = f"runs/r{number:04d}/s{index}/step{step}"
            try:
                saved[ref] = repo.save(checkpoint(number * 1000 + index * 10 + step), ref)
            except Exception as e:
                tally.error("save", e)
                with tally.lock:
                    tally.saves_failed += 1
            with tally.lock:
                tally.saves += 1

    def push() -> None:
        target = local.save(checkpoint(-1 - number), "pushed/latest")
        for ref in ("pushed/latest", f"pushed/r{number:04d}"):
            if ref != "pushed/latest":
                local.set_ref(ref, target)
            try:
                report = local.push(pushed_to, [ref])
                moved = report.refs[0].status in ("created", "updated", "unchanged")
                pushed[ref] = (target, moved)
            except Exception as e:
                tally.error("push", e)
                pushed[ref] = (target, False)
                with tally.lock:
                    tally.pushes_failed += 1
            with tally.lock:
                tally.pushes += 1

    def collect() -> None:
        time.sleep(rng.uniform(0.0, 0.5))  # somewhere in the middle of the saves
        try:
            result = gc_repo.plan_gc(NO_GRACE).execute()
        except Exception as e:
            tally.error("gc", e)
            return
        with tally.lock:
            tally.gc_completed += 1
            tally.chunks_deleted += result.deleted_chunks

    threads = [threading.Thread(target=save, args=(i, r)) for i, r in enumerate(writers)]
    threads += [threading.Thread(target=push), threading.Thread(target=collect)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _check(direct, saved, pushed, tally)


def _check(
    direct: cas.Repository,
    saved: dict[str, Digest],
    pushed: dict[str, tuple[Digest, bool]],
    tally: Tally,
) -> None:
    """Read what the round left straight from the server and count what went wrong."""
    found = direct.verify(list(saved)) if saved else None
    broken = set(found.broken_refs()) if found is not None else set()
    for ref, digest in saved.items():
        record = direct.find_ref(ref)
        if record is None or record.target != digest or ref in broken:
            tally.saves_lost += 1
        elif len(direct.log(ref)) != 1:
            tally.duplicate_events += len(direct.log(ref)) - 1
    for ref, (target, reported_moved) in pushed.items():
        record = direct.find_ref(ref)
        moved = record is not None and record.target == target
        if moved != reported_moved:
            tally.push_misreports += 1
        if ref != "pushed/latest" and record is not None and len(direct.log(ref)) != 1:
            tally.duplicate_events += len(direct.log(ref)) - 1


def main() -> None:
    """Parse the command line, run, print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--loss", type=float, default=0.05, help="share of replies lost")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--savers", type=int, default=3, help="concurrent saving writers")
    parser.add_argument("--mode", choices=("close", "500", "both"), default="both")
    parser.add_argument("--work", default=None, help="directory for temporary data")
    args = parser.parse_args()
    figures = run(args.rounds, args.loss, args.seed, args.savers, mode=args.mode,
                  work=Path(args.work) if args.work else None)  # fmt: skip
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
