"""Workers that put, push, forget or collect garbage in a loop until they are killed.

``tests/test_crash_safety.py`` starts one, kills it with SIGKILL at a random moment, checks the
store, and starts the next where the last one stopped. Every file a worker stores is a
deterministic function of its index, so a check can compare what comes back with what went in.
"""

from __future__ import annotations

import random
from pathlib import Path

import cas
from cas.repo.config import StoreConfig
from cas.retention.gc import GCSettings
from cas.retention.policy import RetentionPolicy, Rule

CONFIG = StoreConfig(chunk_size=16 << 10, cdc_avg_size=4 << 10, inline_max=64)
"""Small chunks, so every operation writes or deletes many objects."""
FILE_SIZE = 48 << 10
FORGET_POLICY = RetentionPolicy(rules=(Rule("fg/ckpt_*", keep_last=2),))
COLLECT_NOW = GCSettings(grace=0.0, reflog_window=0.0)


def file_bytes(index: int) -> bytes:
    """The content stored at ``index``."""
    return random.Random(index).randbytes(FILE_SIZE)


def open_store(store: str) -> cas.Repository:
    """The store the workers and the checks share, created with ``CONFIG``."""
    return cas.open(store, config=CONFIG)


def next_index(repo: cas.Repository, prefix: str) -> int:
    """One past the highest index among the refs under ``prefix`` (0 when there are none)."""
    names = repo.ref_names(prefix)
    return max((int(name.rsplit("_", 1)[1]) for name in names), default=-1) + 1


def put_forever(store: str, work: str) -> None:
    """``cas put`` a file, then a directory of two files, and so on, as ``put/ckpt_<index>``,
    through the command line's own code."""
    from cas.cli import cli

    index = next_index(open_store(store), "put/")
    while True:
        source = Path(work) / f"source_{index:06d}"
        if index % 2:
            source.write_bytes(file_bytes(index))
        else:
            source.mkdir(exist_ok=True)
            (source / "a.bin").write_bytes(file_bytes(index))
            (source / "b.bin").write_bytes(file_bytes(index + 1_000_000))
        ref = f"put/ckpt_{index:06d}"
        cli.main(["--store", store, "-q", "put", str(source), ref], standalone_mode=False)
        index += 1


def push_forever(source: str, dest: str, work: str) -> None:
    """Push the source's refs one at a time, oldest first, skipping those already pushed; once
    every ref is pushed, store the next file in the source (not the store under test) and push it,
    so the worker never runs out of work before it is killed."""
    src, dst = open_store(source), open_store(dest)
    pushed = set(dst.ref_names())
    for name in src.ref_names():
        if name not in pushed:
            src.push(dst, [name], jobs=4)
    index = next_index(src, "src/")
    while True:
        new = f"src/ckpt_{index:06d}"
        if new not in pushed:
            scratch = Path(work) / f"push_{index:06d}"
            scratch.write_bytes(file_bytes(index))
            src.put_path(scratch, new)
            src.push(dst, [new], jobs=4)
        index += 1


def forget_forever(store: str) -> None:
    """Copy a checkpoint to a new ``fg/ckpt_<index>`` ref, then forget all but the last two."""
    repo = open_store(store)
    index = next_index(repo, "fg/")
    while True:
        repo.cp("base", f"fg/ckpt_{index:06d}")
        repo.forget(FORGET_POLICY)
        index += 1


def collect_forever(store: str, work: str) -> None:
    """Store a file, drop the one stored three rounds before, and collect what nothing reaches."""
    repo = open_store(store)
    index = next_index(repo, "gc/")
    while True:
        source = Path(work) / f"gc_{index:06d}"
        source.write_bytes(file_bytes(index))
        repo.put_path(source, f"gc/ckpt_{index:06d}")
        if repo.find_ref(f"gc/ckpt_{index - 3:06d}") is not None:
            repo.rm(f"gc/ckpt_{index - 3:06d}")
        repo.plan_gc(COLLECT_NOW).execute()
        index += 1
