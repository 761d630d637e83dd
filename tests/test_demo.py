"""The README's first command: the demo runs end to end on a fresh local store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"


def test_the_readme_demo_trains_saves_and_reloads_bit_identical(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(DEMO), "--store", str(tmp_path / "demo-store")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "weights bit-identical: True" in done.stdout


def test_cas_history_shows_the_demo_runs_losses(tmp_path: Path) -> None:
    store = tmp_path / "demo-store"
    done = subprocess.run(
        [sys.executable, str(DEMO), "--store", str(store), "--steps", "50"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads((store / "demo-summary.json").read_text())["run"]
    shown = subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(store), "history", run, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    records = json.loads(shown.stdout)
    assert [r["step"] for r in records] == [25, 50]
    assert all(r["loss"] > 0 for r in records)
