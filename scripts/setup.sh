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
# `cas mount` and its tests need libfuse (fusepy loads libfuse.so.2). As root on a Debian-like
# machine with /dev/fuse, install it; elsewhere the mount tests skip and say why (fail, with CI=true).
if [ -e /dev/fuse ] && ! ldconfig -p 2>/dev/null | grep -q 'libfuse\.so\.2'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq libfuse2 fuse3 >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libfuse2 fuse3 >/dev/null 2>&1; } ||
            echo "setup: could not install libfuse; the mount tests will skip (fail with CI=true)" >&2
    else
        echo "setup: libfuse is missing (apt-get install fuse3 libfuse2); the mount tests will skip (fail with CI=true)" >&2
    fi
fi
# The liveness tests set a writer's clock minutes off with libfaketime (Debian package `faketime`).
# As root on a Debian-like machine, install it; elsewhere those tests skip and say why (fail, with
# CI=true). They also run a writer in a new PID namespace (`unshare`, util-linux), as root only.
if ! compgen -G "/usr/lib/*/faketime/libfaketimeMT.so.1" >/dev/null && ! [ -e /usr/lib/faketime/libfaketimeMT.so.1 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq faketime >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq faketime >/dev/null 2>&1; } ||
            echo "setup: could not install faketime; the skewed-clock tests will skip (fail with CI=true)" >&2
    else
        echo "setup: libfaketime is missing (apt-get install faketime); the skewed-clock tests will skip (fail with CI=true)" >&2
    fi
fi
# `cas ui`'s tests drive Debian's headless Chromium through Playwright (the Python package is in the
# dev extra; it downloads no browser of its own). As root on Debian, install it; elsewhere those
# tests skip and say why (fail, with CI=true).
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq chromium >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } ||
            echo "setup: could not install chromium; the ui browser tests will skip (fail with CI=true)" >&2
    else
        echo "setup: chromium is missing (apt-get install chromium); the ui browser tests will skip (fail with CI=true)" >&2
    fi
fi
