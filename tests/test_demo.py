"""The README's first command: the demo runs end to end on a fresh local store."""

from __future__ import annotations

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
