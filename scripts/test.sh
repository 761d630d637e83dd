#!/usr/bin/env bash
# The whole test suite: set up, lint (ruff), type-check (mypy --strict, the tests and scripts too),
# then pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k crash`. With CI=true a missing test
# prerequisite fails the run instead of skipping (tests/prerequisites.py). The 15 slowest tests are
# listed at the end so a test that became slow shows.
# pytest runs in two worker processes (pytest-xdist), each test file whole on one worker, so a
# module's fixtures start once and its tests keep their order: much of the suite waits (SeaweedFS
# round trips, subprocesses, leases running out), so two workers cut the wall time by ~40% on two
# cores. Each worker starts its own SeaweedFS. `bash scripts/test.sh -n 0` runs in one process.
# The files are handed out in collection order, which tests/conftest.py starts with the slowest
# (--no-loadscope-reorder: by default xdist hands out the files with the most tests first, and
# the slowest file, with six tests, began last and ran on alone for minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check cas tests scripts
.venv/bin/ruff format --check -q cas tests scripts
echo "== mypy --strict"
.venv/bin/mypy cas tests scripts
echo "== pytest"
# Compiled once up front: where PYTHONDONTWRITEBYTECODE is set (this machine's environment sets
# it) every process a test starts (CLI runs, drain workers, killed writers) would compile cas
# again, about 0.25 s each.
.venv/bin/python -m compileall -q cas tests scripts
.venv/bin/python -m pytest -p no:cacheprovider -q -n 2 --dist loadfile --no-loadscope-reorder \
    --durations=15 "$@"
