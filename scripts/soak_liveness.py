"""Soak: writers in another PID namespace and five minutes behind, saving while GC runs with grace 0.

    python scripts/soak_liveness.py --minutes 3                 # a local store in a temp dir
    python scripts/soak_liveness.py --minutes 3 --s3            # a SeaweedFS of its own

Starts the chosen writers (``--writers``: ``pidns`` under ``unshare --pid --fork --mount-proc``,
as root; ``behind``, whose cas runs on a clock 300 s back; ``faketime``, whose whole process clock
libfaketime sets 300 s back, faithful on S3 only, since it also fakes the time ``utime(NULL)``
stamps on a local file; ``plain``) that each save
``w<N>/ckpt_*`` in a loop (``tests.gc_workers``: every save re-read in full before it is removed,
the newest two kept), while this process runs ``plan_gc(grace 0).execute()`` back to back. At the
end every kept checkpoint must load bit-exact. Prints JSON: saves reported, saves lost (a
reported save that failed its re-read, or a kept one that no longer loads), refusals, GC runs
and chunks GC deleted. Exits 1 if any save was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cas  # noqa: E402
from cas.repo.config import StoreConfig  # noqa: E402
from cas.retention.gc import GCSettings  # noqa: E402
from cas.testing.worlds import (  # noqa: E402
    clock_offset_env,
    faketime_unavailable,
    in_pid_namespace,
    unshare_unavailable,
)

SAVER = [sys.executable, "-m", "tests.gc_workers"]
CHUNK = 4096
BEHIND = -300.0


def _writer(kind: str, store: str, index: int, seconds: float, out: Path) -> subprocess.Popen[str]:
    argv = [*SAVER, store, str(index), str(seconds), str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if kind == "pidns":
        reason = unshare_unavailable()
        if reason:
            raise SystemExit(f"soak: {reason}")
        argv = in_pid_namespace(argv)
    elif kind == "behind":  # its cas runs on a clock 300 s behind
        argv.append(str(BEHIND))
    elif kind == "faketime":  # the whole process's clock is 300 s behind (libfaketime)
        reason = faketime_unavailable()
        if reason:
            raise SystemExit(f"soak: {reason}")
        env = clock_offset_env(BEHIND, env)
    elif kind != "plain":
        raise SystemExit(f"soak: unknown writer {kind!r} (pidns, behind, faketime, plain)")
    return subprocess.Popen(argv, cwd=ROOT, env=env, text=True)


def soak(store: str, kinds: list[str], seconds: float) -> dict[str, Any]:
    """Run the writers against GC for ``seconds``; the figures."""
    extra: dict[str, Any] = {} if "://" in store else {"fsync": False}
    cas.open(store, config=StoreConfig(chunk_size=CHUNK, inline_max=64), **extra).close()
    outs = [Path(tempfile.mktemp(prefix=f"soak-{kind}-", suffix=".json")) for kind in kinds]
    writers = [
        _writer(k, store, i, seconds, out)
        for i, (k, out) in enumerate(zip(kinds, outs, strict=True))
    ]
    gc = cas.open(store, create=False, **extra)
    settings = GCSettings(grace=0, reflog_window=0)
    runs = deleted = 0
    gc_errors: list[str] = []
    began = time.monotonic()
    while any(w.poll() is None for w in writers):
        try:
            deleted += gc.plan_gc(settings).execute().deleted_chunks
        except cas.CASError as e:  # a refusal is a figure, not the end of the soak
            gc_errors.append(str(e))
        runs += 1
    deleted += gc.plan_gc(settings).execute().deleted_chunks
    per_writer: dict[str, Any] = {}
    lost_total = reported_total = 0
    repo = cas.open(store, create=False)
    kept = {r.name for r in repo.refs()}
    from tests.gc_workers import state
    from tests.helpers import assert_bit_exact

    for kind, out, writer in zip(kinds, outs, writers, strict=True):
        outcome = json.loads(out.read_text()) if out.exists() else {"saved": [], "problems": []}
        out.unlink(missing_ok=True)
        saved = {ref: seeds for ref, seeds in outcome["saved"]}
        # A problem line names the save (``w0/ckpt_00012: missing-chunk: ...``); count saves.
        lost = len({problem.split(":", 1)[0] for problem in outcome["problems"]})
        for name in kept & saved.keys():
            try:
                assert_bit_exact(repo.load(name), state(*saved[name]))
            except (AssertionError, cas.CASError):
                lost += 1
        per_writer[f"{kind}{len(per_writer)}"] = {
            "saves_reported": len(saved),
            "saves_lost": lost,
            "refused": outcome.get("refused", 0),
            "exit": writer.returncode,
            "problems": outcome["problems"][:3],
        }
        lost_total += lost
        reported_total += len(saved)
    return {
        "store": "s3" if "://" in store else "local",
        "seconds": round(time.monotonic() - began, 1),
        "saves_reported": reported_total,
        "saves_lost": lost_total,
        "writers": per_writer,
        "gc_runs": runs,
        "gc_errors": gc_errors[:5],
        "gc_deleted_chunks": deleted,
    }


def main() -> None:
    """Parse the arguments, run the soak, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument(
        "--writers",
        help="pidns, behind, faketime, plain (default: pidns,behind; pidns,faketime with --s3)",
    )
    parser.add_argument("--s3", action="store_true", help="a SeaweedFS of its own")
    args = parser.parse_args()
    kinds = (args.writers or ("pidns,faketime" if args.s3 else "pidns,behind")).split(",")
    seconds = args.minutes * 60
    with tempfile.TemporaryDirectory(prefix="soak-liveness-") as tmp:
        if args.s3:
            from cas.testing import seaweed

            with seaweed.SeaweedServer(Path(tmp) / "weed") as server:
                os.environ.update(
                    AWS_ENDPOINT_URL=server.endpoint_url,
                    AWS_ACCESS_KEY_ID=seaweed.DUMMY_ACCESS_KEY,
                    AWS_SECRET_ACCESS_KEY=seaweed.DUMMY_SECRET_KEY,
                    AWS_DEFAULT_REGION=seaweed.REGION,
                )
                server.client().create_bucket(Bucket="soak")
                figures = soak("s3://soak/liveness", kinds, seconds)
        else:
            figures = soak(str(Path(tmp) / "store"), kinds, seconds)
    print(json.dumps(figures, indent=2))
    sys.exit(1 if figures["saves_lost"] else 0)


if __name__ == "__main__":
    main()
