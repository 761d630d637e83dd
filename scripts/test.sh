#!/usr/bin/env bash
# The whole test suite: set up, lint (ruff), type-check (mypy --strict), then pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k crash`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check cas tests scripts
.venv/bin/ruff format --check -q cas tests scripts
echo "== mypy --strict"
.venv/bin/mypy cas
echo "== pytest"
.venv/bin/python -m pytest -p no:cacheprovider -q "$@"
