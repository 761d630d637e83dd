"""The core benchmark still runs and reports its peers, the disk's floor and cas side by side.

Its figures are not checked (timings belong to benchmarks, not tests); only that one quick run
produces every row the closing figures are read from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_core_benchmark_reports_every_peer_the_floor_and_cas_put_in_one_run(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench.json"
    options = ["--quick", "--size-gb", "0.02", "--sections", "core", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), *options, "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    core = json.loads(out.read_text())["sections"]["core"]
    assert set(core["rows"]) == {"torch.save", "safetensors", "dcp", "cas"}
    assert set(core["ceiling_s"]) == {"one file", "parallel", "direct", "direct chunks"}
    assert all(seconds > 0 for seconds in core["ceiling_s"].values())
    assert core["put_pt_s"] > 0
    assert core["resave_floor_s"] > 0
    assert core["ceiling"]["resave_floor_vs_torch_save"] == pytest.approx(
        core["resave_floor_s"] / core["rows"]["torch.save"]["save"]
    )
    assert "re-save floor" in run.stdout
    assert set(core["targets"]) == {
        "first_save_vs_torch_save_throughput",
        "resave10_vs_torch_save_time",
        "load_vs_torch_load_speed",
        "cold_load_vs_torch_load_speed",
    }
    assert set(core["cold_load_s"]) == {"torch.save", "safetensors", "dcp", "cas"}
    assert all(len(times) >= 1 for times in core["cold_load_rounds_s"].values())
    assert "plain durable writes of the same bytes" in run.stdout
    assert "cold load of each" in run.stdout


def test_the_write_shapes_benchmark_reports_every_shape_beside_cas(tmp_path: Path) -> None:
    out = tmp_path / "shapes.json"
    options = ["--size-gb", "0.02", "--repeat", "1", "--json", str(out), "--workdir", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_write_shapes.py"), *options],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    shapes = ["small pages", "huge pages", "+ temp and link", "+ header and truncate"]
    assert list(result["median_s"]) == [*shapes, "+ blake3 first", "cas"]
    assert all(len(times) == 1 and times[0] > 0 for times in result["rounds_s"].values())
    assert result["files"] > 0 and "cas" in run.stdout
