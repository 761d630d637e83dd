#!/usr/bin/env bash
# Create .venv and install cas with its dev tools. Idempotent: a second run only checks.
# torch is pinned to the CPU build 2.13.0 here so CI does not download a CUDA build; the
# package itself accepts any torch >= 2.4.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.cas-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[dev,hf,lightning]"
    rm -f .venv/.cas-setup-*
    touch "$stamp"
fi
