"""``scripts/bench_compression.py`` runs end to end in quick mode and prints, beside the figures,
what bounds them: the load floor, the load with one read at a time against the default, and the
order-0 entropy of the best delta chain under each stored ratio."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_bench_peers import script


def test_the_entropy_bound_of_a_run_whose_second_checkpoint_repeats_the_first(
    tmp_path: Path,
) -> None:
    """Each byte plane of the first checkpoint takes 64 values equally often (6 bits a byte);
    the second is the same tensor, so its XOR against the first costs nothing."""
    floor = script("compression_floor")
    planes = np.tile(np.arange(256, dtype=np.uint8), 1024)  # byte 4i+p is (4i+p) mod 256
    weight = torch.from_numpy(planes.view(np.float32).copy())
    paths = []
    for step in (1, 2):
        path = tmp_path / f"step{step}.pt"
        torch.save({"model": {"w": weight}, "step": step}, path)
        paths.append(path)
    bound = floor.entropy_bound(paths)
    files = sum(p.stat().st_size for p in paths)
    assert bound["first"] == pytest.approx(0.75 * planes.nbytes / files)
    assert bound["w"] == 0.0
    assert bound["run"] == pytest.approx(0.75 * planes.nbytes / files)


def test_quick_run_prints_every_bound_beside_its_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The GPT workloads only: the MiniLM one needs the pretrained model of the ``bench`` extra,
    which the test setup does not install."""
    bench = script("bench_compression")
    gpt = ["gpt-fp32", "gpt-bf16", "gpt-bf16-adamw"]
    results = bench.run(quick=True, workdir=str(tmp_path), only=gpt)
    rows = results["workloads"]
    assert list(rows) == gpt
    for row in rows.values():
        cas = row["cas"]
        assert cas["ceiling"]["raw_s"] > 0 and cas["ceiling"]["packed_s"] > 0
        load = cas["parallel_load"]
        assert load["serial_s"] > 0 and load["parallel_s"] > 0
        assert load["speedup"] == pytest.approx(load["serial_s"] / load["parallel_s"])
        bound = cas["entropy_bound"]
        # A lower bound on what a byte-plane coder stores: below what cas stored.
        assert 0 < bound["run"] < cas["ratio"]
        assert {"first", "weight", "exp_avg", "exp_avg_sq"} <= set(bound)
    table = capsys.readouterr().out
    assert "bound" in table and "1 read ms" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("gpt-fp32 ") and "nan" not in ln)
    assert not math.isnan(float(line.split()[-1]))


def test_an_unknown_workload_is_named_in_the_refusal(tmp_path: Path) -> None:
    bench = script("bench_compression")
    with pytest.raises(SystemExit, match="no workload named gpt-fp64"):
        bench.run(quick=True, workdir=str(tmp_path), only=["gpt-fp64", "gpt-fp32"])
