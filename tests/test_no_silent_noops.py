"""What a user mistypes fails loudly in one line; what a shell or pandas does exits as expected."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import save_file

import cas
from cas.errors import NotFound, NothingSelected
from cas.training.manager import CheckpointManager
from tests.helpers import run_cli


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode != 0, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cas: error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    repo = cas.open(root)
    repo.save({"model": {"w": torch.arange(4096.0)}}, "runs/r1/ckpt_1")
    return root


@pytest.mark.parametrize("command", ["verify", "du"])
def test_verify_or_du_of_a_mistyped_ref_fails_instead_of_saying_ok(
    store: Path, command: str
) -> None:
    assert_one_line_error(run_cli(store, command, "runs/r2"), "no ref matches 'runs/r2'")
    assert run_cli(store, command, "runs/r1").returncode == 0


def test_load_with_keys_that_match_nothing_names_the_pattern(store: Path) -> None:
    repo = cas.open(store)
    with pytest.raises(NotFound, match=r"'modle\.\*' match nothing in runs/r1/ckpt_1.*model\.w"):
        repo.load("runs/r1/ckpt_1", keys="modle.*")
    assert set(repo.load("runs/r1/ckpt_1", keys=["modle.*", "model.*"])) == {"model"}


def test_resume_with_a_mistyped_key_fails_at_once_instead_of_falling_back(store: Path) -> None:
    repo = cas.open(store)
    with CheckpointManager(repo, run="r9", signals=False, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": {"w": torch.full((8,), float(step))}})
        with pytest.raises(NothingSelected, match="modle"):
            mgr.restore("resume", keys="modle.*")


def test_cas_filesystem_without_a_store_never_creates_one_in_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CAS_STORE", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    with pytest.raises(NotFound, match="CAS_STORE"):
        fsspec.filesystem("cas", skip_instance_cache=True)
    assert not (tmp_path / "data").exists()
    cas.open(tmp_path / "data" / "cas" / "store")  # `cas init` made one there: it is used
    assert fsspec.filesystem("cas", skip_instance_cache=True).ls("") == []


def test_pandas_style_storage_options_give_the_real_reason_a_write_is_refused(
    store: Path,
) -> None:
    # pandas opens with its storage options and retries a PermissionError with anon=True.
    for anon in (False, True):
        opened = fsspec.open("cas://top.csv", "wb", store=str(store), anon=anon)
        with pytest.raises(PermissionError, match="needs a checkpoint directory"), opened as f:
            f.write(b"a,b\n1,2\n")
    with fsspec.open("cas://tables/top.csv", "wb", store=str(store), anon=False) as f:
        f.write(b"a,b\n1,2\n")
    assert cas.open(store).load("tables")["top.csv"] == b"a,b\n1,2\n"
    with pytest.raises(TypeError, match="storage option 'colour'"):
        fsspec.filesystem("cas", store=str(store), colour="red", skip_instance_cache=True)


def test_get_into_a_new_directory_named_with_a_slash_writes_inside_it(
    store: Path, tmp_path: Path
) -> None:
    single = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(16)}, single)
    cas.open(store).put_path(single, "files/model")
    done = run_cli(store, "get", "files/model", "restored/", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "restored" / "model.safetensors").read_bytes() == single.read_bytes()
    written = cas.open(store).get_path("runs/r1/ckpt_1", f"{tmp_path / 'exported'}/")
    assert written == [tmp_path / "exported" / "checkpoint.pt"]


def test_cas_ls_into_a_reader_that_stops_early_exits_quietly(store: Path) -> None:
    ls = subprocess.Popen(
        [sys.executable, "-m", "cas", "--store", str(store), "ls"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert ls.stdout is not None and ls.stderr is not None
    ls.stdout.close()  # like `| head -1` after its line: every write now fails with EPIPE
    _, err = ls.communicate(timeout=120)
    assert ls.returncode == 0 and err == b"", err


def test_bare_cas_prints_the_help(store: Path) -> None:
    bare = subprocess.run(
        [sys.executable, "-m", "cas"], capture_output=True, text=True, timeout=120
    )
    assert bare.returncode == 0, bare.stderr
    assert "Usage: cas" in bare.stdout and "Commands:" in bare.stdout and not bare.stderr


def test_a_refused_pt_names_the_class_and_the_cli_flag(store: Path, tmp_path: Path) -> None:
    path = tmp_path / "dated.pt"
    torch.save({"when": datetime.datetime(2026, 1, 15)}, path)
    line = assert_one_line_error(
        run_cli(store, "put", str(path), "x/dated"),
        "global datetime.datetime is not allowed",
        "--allow-opaque-pickles stores it",
    )
    assert "allow_opaque_pickles" not in line


def test_gc_after_forget_says_what_waits_for_the_grace_period_and_until_when(
    store: Path,
) -> None:
    repo = cas.open(store)
    repo.save({"big": torch.randn(3 << 18)}, "runs/r1/ckpt_2")  # 3 MiB
    repo.rm("runs/r1/ckpt_2")
    done = run_cli(store, "gc")
    assert done.returncode == 0, done.stderr
    assert "freed 0 B" in done.stdout
    assert "waiting: 3.0 MiB no ref needs" in done.stdout
    assert "collectable by" in done.stdout and "run `cas gc` then" in done.stdout
    plan = json.loads(run_cli(store, "gc", "--dry-run", "--json").stdout)["plan"]
    assert plan["waiting_bytes"] >= 3 << 20
    assert 3000 < plan["waiting_until"] - plan["now"] <= 3600
    collected = run_cli(store, "gc", "--grace", "0s", "--reflog-window", "0s")
    assert "waiting" not in collected.stdout


def test_forget_dry_run_names_what_it_keeps(store: Path) -> None:
    repo = cas.open(store)
    repo.save({"model": {"w": torch.zeros(8)}}, "runs/r1/ckpt_2")
    dry = run_cli(store, "forget", "--select", "runs/r1/ckpt_*", "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert any(
        line.startswith("keep") and "runs/r1/ckpt_2" in line for line in dry.stdout.splitlines()
    )
    assert any(
        line.startswith("DROP") and "runs/r1/ckpt_1" in line for line in dry.stdout.splitlines()
    )


def test_a_mistyped_store_path_is_one_error_and_leaves_nothing_behind(tmp_path: Path) -> None:
    missing = tmp_path / "typo" / "store"
    for args in (["ls"], ["verify"], ["stats"]):
        listed = run_cli(missing, *args)
        assert listed.returncode != 0 and "no cas store" in listed.stderr, listed.stderr
        assert len(listed.stderr.strip().splitlines()) == 1, listed.stderr
    assert not (tmp_path / "typo").exists()  # nothing created on the way to the error
