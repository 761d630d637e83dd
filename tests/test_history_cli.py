"""`cas history` prints a run's training history as a table, JSON or CSV, checked against a run."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import cas
from cas.cli import cli
from cas.training.history import TrainingHistory
from cas.training.manager import CheckpointManager

LOSSES = [2.5, 1.75, 1.3125, 0.1 + 0.2]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A scripted run: a loss record per step, a save every second step, then a resume."""
    root = tmp_path / "store"
    repo = cas.open(root)
    with CheckpointManager(repo, run="r1", signals=False, every_n_steps=2) as mgr:
        for step, loss in enumerate(LOSSES, start=1):
            mgr.record(step, loss=loss, lr=1e-3)
            mgr.step_end(step, {"w": torch.full((8,), float(step))}, {"loss": loss})
    with CheckpointManager(repo, run="r1", signals=False) as mgr:
        mgr.restore("resume")
    return root


def cas_history(store: Path, *args: str) -> str:
    result = CliRunner().invoke(cli, ["--store", str(store), "history", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_history_prints_the_runs_records_as_a_table(store: Path) -> None:
    lines = cas_history(store, "runs/r1").splitlines()
    assert lines[0].split() == [
        "step", "event", "loss", "lr", "ref", "trigger", "status", "metrics.loss", "skipped",
    ]  # fmt: skip
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[1]) for r in rows] == [
        ("1", "-"), ("2", "-"), ("2", "save"), ("3", "-"), ("4", "-"), ("4", "save"),
        ("4", "resume"),
    ]  # fmt: skip
    assert rows[1][2] == "1.75" and rows[4][2] == "0.3"  # 0.30000000000000004 to 6 digits
    assert rows[2][4] == "runs/r1/phase1/ckpt_phase1_step00000002"
    assert rows[6][-1] == "[]"


def test_history_json_and_csv_hold_exactly_what_was_recorded(store: Path) -> None:
    stored = TrainingHistory(cas.open(store), "runs/r1/history").read()
    assert json.loads(cas_history(store, "runs/r1/history", "--json")) == stored
    table = list(csv.DictReader(io.StringIO(cas_history(store, "runs/r1", "--csv"))))
    losses = [float(row["loss"]) for row in table if row["loss"]]
    assert losses == LOSSES  # repr round-trips every bit
    saves = [row for row in table if row["event"] == "save"]
    assert [(row["step"], row["metrics.loss"]) for row in saves] == [
        ("2", "1.75"),
        ("4", "0.30000000000000004"),
    ]
    only_saves = json.loads(cas_history(store, "runs/r1", "--json", "--event", "save"))
    assert [r["step"] for r in only_saves] == [2, 4]


def test_history_of_a_run_that_does_not_exist_fails_in_one_line(store: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(store), "history", "runs/r2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "cas: error: NothingSelected: no training history at runs/r2 or runs/r2/history"
    )
