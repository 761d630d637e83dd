"""`import cas` and every command that moves no tensor through memory start without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

import cas
from cas.training.history import TrainingHistory

# Runs each command in order in one fresh interpreter and reports, per command, whether torch
# was imported by then; a command that fails is reported too, so a failure names its command.
_DRIVER = """
import json, sys
import cas
import cas.cli
report = {"after import": "torch" in sys.modules}
for args in json.loads(sys.argv[1]):
    try:
        cas.cli.cli.main(args, prog_name="cas", standalone_mode=False)
    except SystemExit as e:
        if e.code:
            raise
    report[" ".join(args)] = "torch" in sys.modules
print(json.dumps(report))
"""


def _commands(tmp_path: Path) -> list[list[str]]:
    store, mirror = str(tmp_path / "store"), str(tmp_path / "mirror")
    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": np.arange(4096, dtype=np.float32)}, str(src / "model.safetensors"))
    (src / "notes.bin").write_bytes(bytes(range(256)) * 64)
    checkpoint = src / "checkpoint-3"
    checkpoint.mkdir()
    torch.save({"exp_avg": torch.randn(64, 64), "step": torch.tensor(3.0)}, checkpoint / "opt.pt")
    torch.save({"w": torch.ones(8)}, src / "legacy.pt", _use_new_zipfile_serialization=False)
    (checkpoint / "trainer_state.json").write_text('{"global_step": 3}')
    TrainingHistory(cas.open(store), "runs/r1/history").append([{"step": 1, "loss": 0.5}])
    s = ["--store", store]
    return [
        ["--version"],
        [*s, "put", str(src / "model.safetensors"), "runs/r1/model"],
        [*s, "put", str(src / "notes.bin"), "runs/r1/notes"],
        [*s, "put", str(checkpoint), "runs/r1/checkpoint-3"],
        [*s, "put", str(src / "legacy.pt"), "runs/r1/legacy"],
        [*s, "ls"],
        [*s, "ls", "runs/r1", "--json"],
        [*s, "show", "runs/r1/checkpoint-3"],
        [*s, "log", "runs/r1/model"],
        [*s, "history", "runs/r1"],
        [*s, "history", "runs/r1", "--csv"],
        [*s, "du", "-r"],
        [*s, "stats"],
        [*s, "verify", "--full"],
        [*s, "cp", "runs/r1/model", "gates/best"],
        [*s, "rm", "runs/r1/notes"],
        [*s, "forget", "--select", "runs/**", "--keep-last", "2"],
        [*s, "gc", "--grace", "0s"],
        [*s, "push", "--to", mirror, "gates/best"],
        [*s, "pull", "--from", mirror, "gates/best"],
        [*s, "get", "runs/r1/checkpoint-3", str(tmp_path / "back")],
        [*s, "get", "gates/best", str(tmp_path / "best.safetensors")],
    ]


def test_cli_commands_that_move_no_tensors_never_import_torch(tmp_path: Path) -> None:
    commands = _commands(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report) == len(commands) + 1, report  # every command ran
    first = next((step for step, imported in report.items() if imported), None)
    assert first is None, f"torch was first imported by: cas {first}"
    # The commands did their work: ingested files come back byte-identical.
    original = tmp_path / "src" / "checkpoint-3" / "opt.pt"
    assert (tmp_path / "back" / "opt.pt").read_bytes() == original.read_bytes()
    safetensors = (tmp_path / "src" / "model.safetensors").read_bytes()
    assert (tmp_path / "best.safetensors").read_bytes() == safetensors


def test_the_checkpoint_manager_loads_without_torch_until_a_tensor_is_built() -> None:
    probe = (
        "import sys, cas; before = 'torch' in sys.modules; cas.CheckpointManager; "
        "print(before, 'torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_import_cas_and_its_cli_load_neither_torch_nor_numpy() -> None:
    # numpy alone costs about half of a cas command's start-up; it loads when arrays are made.
    probe = "import sys, cas, cas.cli; print('torch' in sys.modules, 'numpy' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_a_job_that_saves_and_loads_imports_no_encryption_gc_file_parsers_or_boto3(
    tmp_path: Path,
) -> None:
    # A job landing on a new node pays for every module it imports before its first step (and
    # each import's objects feed the garbage collector, whose full passes cost ~0.1 s next to a
    # model): those a save and a load never use load when first used instead.
    probe = (
        "import sys, numpy as np, cas, cas.blobstore.s3\n"
        "from cas.training.manager import CheckpointManager\n"
        f"repo = cas.open({str(tmp_path / 'store')!r})\n"
        "repo.save({'w': np.arange(4.0)}, 'runs/r/a')\n"
        "assert repo.load('runs/r/a')['w'].tolist() == [0.0, 1.0, 2.0, 3.0]\n"
        "repo.close()\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "    ('cryptography', 'boto3', 's3transfer') or m in (\n"
        "    'cas.blobstore.sealed', 'cas.retention.gc', 'cas.retention.status',\n"
        "    'cas.retention.verify', 'cas.retention.space', 'cas.retention.plan',\n"
        "    'cas.formats._torchzip', 'cas.formats._pickle_scan', 'cas.model.describe',\n"
        "    'cas.repo.archive', 'cas.repo.ingest', 'cas.repo.shards'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == []


def test_what_loads_on_first_use_still_works_in_a_fresh_process(tmp_path: Path) -> None:
    # The lazily imported parts, each first used in a process that has not loaded them: an
    # encrypted store, GC and its status, the file parsers (cas put of a .safetensors), and
    # s3transfer's failure once a managed transfer has loaded it.
    tensors = {"w": np.arange(6, dtype=np.float32)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    probe = f"""
import os, sys, numpy as np, cas
os.environ["CAS_KEY"] = "a passphrase"
sealed = cas.open({str(tmp_path / "sealed")!r}, encrypt=True)
sealed.save({{"w": np.arange(3.0)}}, "runs/r/a")
assert sealed.load("runs/r/a")["w"].tolist() == [0.0, 1.0, 2.0]
assert "cryptography" in sys.modules
repo = cas.open({str(tmp_path / "plain")!r})
repo.put_path({str(tmp_path / "w.safetensors")!r}, "files/w")
assert repo.show("files/w")["kind"] == "files"
repo.save({{"w": np.arange(3.0)}}, "runs/r/a")
repo.rm("runs/r/a")
assert type(repo.plan_gc()).__name__ == "GCPlan"
assert repo.status(lock=False).refs >= 1
from cas.blobstore.s3.errors import Location, translated
import s3transfer.exceptions
from cas.errors import TransientBackendError
try:
    with translated(Location("s3://b/p", "b", "http://h"), "GET", "k"):
        raise s3transfer.exceptions.RetriesExceededError(OSError("reset"))
except TransientBackendError as e:
    print("transient", e)
"""
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("transient cannot reach S3 endpoint http://h"), result.stdout
