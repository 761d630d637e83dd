"""Plant bugs in core guarantees, one at a time, and check that the test suite catches each.

Each bug is a one-place edit of cas's source (a sync, an fsync, a byte swap, a re-check or a lease
check taken out). The script copies ``cas/``, ``tests/`` and ``pyproject.toml`` into a scratch
directory per bug, applies the edit there (the working tree is never touched), runs the tests
named for it and reports whether they failed, as they must:

    python scripts/planted_bugs.py [--only SUBSTRING] [--list]

Exit status 1 if any planted bug went uncaught (or an edit no longer applies: the code it names
moved, and the table here needs updating).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Bug:
    """One planted bug: replace ``old`` (which must occur exactly once) by ``new`` in ``path``."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


ORDER = ("tests/test_write_order.py",)
LAYERS = ("tests/test_gc_layers.py",)
BYTES = ("tests/test_byte_order.py",)
DOOR = ("tests/test_read_door.py",)

BUGS = (
    Bug(
        "save: the manifest is not synced before the ref moves",
        "cas/repo/core.py",
        '        digest = self.objects.put_manifest(encode_manifest(manifest), codec_by_name("zstd"))\n'
        "        self.objects.sync()\n",
        '        digest = self.objects.put_manifest(encode_manifest(manifest), codec_by_name("zstd"))\n',
        ORDER,
    ),
    Bug(
        "save: the chunks are not synced before the manifest",
        "cas/repo/core.py",
        "        self.leases.check()\n        self.objects.sync()\n        digest",
        "        self.leases.check()\n        digest",
        ORDER,
    ),
    Bug(
        "local: a manifest's file is not fsynced",
        "cas/blobstore/local.py",
        "            tmp = self._write_temp(*parts, fsync=durable)",
        '            tmp = self._write_temp(*parts, fsync=durable and not key.startswith("manifests/"))',
        ORDER,
    ),
    Bug(
        "local: a manifest's directory entry is not fsynced",
        "cas/blobstore/local.py",
        "        if durable:\n            with self._dirty_lock:",
        '        if durable and not key.startswith("manifests/"):\n            with self._dirty_lock:',
        ORDER,
    ),
    Bug(
        "push: the manifest is not synced before the remote ref moves",
        "cas/sync/transfer.py",
        "            report.manifests_skipped += 1\n    dst.objects.sync()\n",
        "            report.manifests_skipped += 1\n",
        ORDER,
    ),
    Bug(
        "numpy: a big-endian array is not swapped when saved",
        "cas/model/state.py",
        "    if contiguous.dtype != little:",
        "    if False:",
        BYTES,
    ),
    Bug(
        "numpy: a big-endian entry is not swapped when loaded",
        "cas/model/state.py",
        "    if not np_dtype.isnative:",
        "    if False:",
        BYTES,
    ),
    Bug(
        "read: a chunk is hashed outside the read door",
        "cas/objects/store.py",
        '        readcheck.verify_digest(decoded, digest, f"chunk {digest} (or a delta base of it)")\n',
        "        if digest_of(decoded) != digest:\n"
        '            raise IntegrityError(f"chunk {digest} is corrupt")\n',
        DOOR,
    ),
    Bug(
        "gc: the grace period is ignored",
        "cas/retention/gc.py",
        "        cutoff = now - settings.grace\n",
        "        cutoff = now\n",
        LAYERS,
    ),
    Bug(
        "gc: a live lease does not lower the cutoff",
        "cas/retention/gc.py",
        "            cutoff = min(cutoff, min(lease.started for lease in live) - margin)\n",
        "            pass\n",
        LAYERS,
    ),
    Bug(
        "writer: a reused chunk is not freshened",
        "cas/objects/store.py",
        "                self.blobs.touch(chunk_key(digest))\n",
        "                pass\n",
        LAYERS,
    ),
    Bug(
        "gc: the sweep's re-check after its rename is gone",
        "cas/objects/sweep.py",
        "        if st.st_mtime >= cutoff:\n            self._put_back(Path(trashed), Path(home))\n",
        "        if False:\n            self._put_back(Path(trashed), Path(home))\n",
        LAYERS,
    ),
    Bug(
        "writer: a commit does not settle against GC's sweep windows",
        "cas/refs/store.py",
        "            self.leases.settle(lambda: self._missing(record))\n",
        "            pass\n",
        LAYERS,
    ),
    Bug(
        "gc: deletes after its sweep window ran out",
        "cas/refs/sweeps.py",
        "        if now >= self.expires - self.margin:\n",
        "        if False:\n",
        LAYERS,
    ),
    Bug(
        "gc: expired leases' refs are not fenced",
        "cas/retention/gc.py",
        "        for lease in self.expired_leases:\n            writer = (FencedWriter",
        "        for lease in ():\n            writer = (FencedWriter",
        LAYERS,
    ),
    Bug(
        "writer: no lease check before the ref write",
        "cas/refs/store.py",
        "            self.leases.settle(lambda: self._missing(record))\n        self._check_lease()\n",
        "            self.leases.settle(lambda: self._missing(record))\n",
        LAYERS,
    ),
    Bug(
        "writer: no lease check before a ref delete",
        "cas/refs/store.py",
        "    def _delete_record(self, current: RefRecord) -> None:\n        self._check_lease()\n",
        "    def _delete_record(self, current: RefRecord) -> None:\n",
        LAYERS,
    ),
    Bug(
        "writer: no lease check when declaring a ref",
        "cas/refs/leases.py",
        "            now = self.clock()\n            self._raise_if_expired(now)\n"
        "            self.commits = (*self.commits, ref)\n",
        "            now = self.clock()\n            self.commits = (*self.commits, ref)\n",
        LAYERS,
    ),
    Bug(
        "writer: no lease check before the manifest is stored",
        "cas/repo/core.py",
        "        self.leases.check()\n        self.objects.sync()\n        digest",
        "        self.objects.sync()\n        digest",
        LAYERS,
    ),
    Bug(
        "gc: planning takes no maintenance lock",
        "cas/retention/gc.py",
        '    with maintenance.lock("gc", enabled=lock):\n        sweeper = stores.objects.sweeper()',
        '    with maintenance.lock("gc", enabled=False):\n        sweeper = stores.objects.sweeper()',
        LAYERS,
    ),
)


def _scratch_copy(into: Path) -> None:
    for name in ("cas", "tests"):
        shutil.copytree(
            ROOT / name, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    shutil.copy2(ROOT / "pyproject.toml", into / "pyproject.toml")


def _pytest(root: Path, tests: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *tests],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=900,
    )


def check(bug: Bug | None, tests: tuple[str, ...] = ()) -> tuple[str, str]:
    """Plant ``bug`` in a scratch copy and run its tests: (verdict, the failing tests' lines).
    With no bug, run ``tests`` on the unchanged copy: they must pass ("clean")."""
    with tempfile.TemporaryDirectory(prefix="cas-planted-") as scratch:
        root = Path(scratch)
        _scratch_copy(root)
        if bug is not None:
            target = root / bug.path
            source = target.read_text()
            if source.count(bug.old) != 1:
                return "NOT PLANTED", f"the text to replace occurs {source.count(bug.old)} times"
            target.write_text(source.replace(bug.old, bug.new))
            tests = bug.tests
        run = _pytest(root, tests)
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    if bug is None:
        verdict = "clean" if run.returncode == 0 else "BROKEN"
    else:
        verdict = "caught" if run.returncode == 1 and failed else "MISSED"
    return verdict, "\n".join(f"    {line[:160]}" for line in failed)


def main() -> int:
    """Run the table; 1 if a bug was missed or could not be planted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="only bugs whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the bugs and their tests")
    args = parser.parse_args()
    bugs = [bug for bug in BUGS if args.only in bug.name]
    if args.list:
        for bug in bugs:
            print(f"{bug.name}  [{bug.path}; {' '.join(bug.tests)}]")
        return 0
    # The tests must pass before anything is planted, or a failure proves nothing.
    baseline, detail = check(None, tuple(sorted({t for bug in bugs for t in bug.tests})))
    print(f"{baseline:12} (no bug planted)")
    if baseline != "clean":
        print(detail)
        return 1
    bad = 0
    for bug in bugs:
        verdict, detail = check(bug)
        bad += verdict != "caught"
        print(f"{verdict:12} {bug.name}")
        if detail:
            print(detail)
    print(f"{len(bugs) - bad} of {len(bugs)} planted bugs caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
