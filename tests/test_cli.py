"""The CLI as a user drives it: put/get byte-identical, listings with --json, sidecars, verify."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import cas
from cas.cli import cli
from tests.helpers import trained_state


@dataclass
class StoreCLI:
    """The ``cas`` command line on one store: ``run("ls", "--json")`` returns what it printed."""

    store: Path
    runner: CliRunner = field(default_factory=CliRunner)

    def __call__(self, *args: str, ok: bool = True) -> str:
        """Run ``cas --store STORE *args``; ``ok`` says whether it must exit 0 or must fail."""
        result = self.runner.invoke(
            cli, ["--store", str(self.store), *args], catch_exceptions=False
        )
        if ok:
            assert result.exit_code == 0, result.output
        else:
            assert result.exit_code != 0, result.output
        return result.output


@pytest.fixture
def run(tmp_path: Path) -> StoreCLI:
    return StoreCLI(tmp_path / "store")


def _hf_checkpoint(root: Path) -> Path:
    ckpt = root / "checkpoint-500"
    ckpt.mkdir(parents=True)
    state = trained_state(width=64)
    save_file(
        {k: v.contiguous() for k, v in state["model"].items()},
        ckpt / "model.safetensors",
        metadata={"format": "pt"},
    )
    torch.save(state["optimizer"], ckpt / "optimizer.pt")
    torch.save(state["scheduler"], ckpt / "scheduler.pt")
    torch.save({"python": 1, "cpu": torch.get_rng_state()}, ckpt / "rng_state.pth")
    (ckpt / "trainer_state.json").write_text(
        json.dumps({"global_step": 500, "log_history": [{"loss": 1.0}] * 50})
    )
    (ckpt / "nested").mkdir()
    (ckpt / "nested" / "notes.txt").write_bytes(os.urandom(3000))
    return ckpt


def test_put_get_directory_is_byte_identical(run: StoreCLI, tmp_path: Path) -> None:
    ckpt = _hf_checkpoint(tmp_path)
    out = run("put", str(ckpt), "runs/hf/checkpoint-500", "--json")
    assert json.loads(out)["new_chunks"] > 0
    run("get", "runs/hf/checkpoint-500", str(tmp_path / "restored"))
    for path in ckpt.rglob("*"):
        if path.is_file():
            restored = tmp_path / "restored" / path.relative_to(ckpt)
            assert restored.read_bytes() == path.read_bytes(), path
    again = json.loads(run("put", str(ckpt), "runs/hf/checkpoint-500-copy", "--json"))
    assert again["new_bytes"] == 0


@pytest.mark.parametrize("kind", ["pt", "safetensors", "opaque"])
def test_put_get_single_file_with_sha256_sidecar(run: StoreCLI, tmp_path: Path, kind: str) -> None:
    source = tmp_path / f"model.{kind}"
    state = {"w": torch.randn(300, 300), "b": torch.randn(300).bfloat16()}
    if kind == "pt":
        torch.save(state, source)
    elif kind == "safetensors":
        save_file(state, source)
    else:
        source.write_bytes(os.urandom(3 << 20) + b"tail")
    run("put", str(source), f"files/{kind}")
    dest_dir = tmp_path / "out"
    dest_dir.mkdir()
    written = run("get", f"files/{kind}", str(dest_dir), "--sha256").split()
    target = dest_dir / source.name
    assert target.read_bytes() == source.read_bytes()
    assert str(target) + ".sha256" in written
    if shutil.which("sha256sum"):
        check = subprocess.run(
            ["sha256sum", "-c", source.name + ".sha256"],
            cwd=dest_dir,
            capture_output=True,
            text=True,
        )
        assert check.returncode == 0 and "OK" in check.stdout


def test_export_state_saved_from_python(run: StoreCLI, tmp_path: Path) -> None:
    from safetensors import safe_open

    repo = cas.open(run.store)
    state = trained_state()
    repo.save(state, "runs/api/ckpt")
    run("get", "runs/api/ckpt", str(tmp_path / "c.safetensors"), "--format", "safetensors")
    with safe_open(str(tmp_path / "c.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.0.weight"), state["model"]["0.weight"])
    run("get", "runs/api/ckpt", str(tmp_path / "c.pt"), "--format", "pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert torch.equal(
        loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"]
    )


def test_listing_show_log_diff_and_cp(run: StoreCLI, tmp_path: Path) -> None:
    repo = cas.open(run.store)
    state = trained_state()
    for step in (100, 200):
        state["model"]["0.bias"] = state["model"]["0.bias"] + 1
        repo.save(state, f"runs/r1/phase1/ckpt_phase1_step{step:08d}", metadata={"step": step})
        repo.save(state, "runs/r1/latest", metadata={"step": step})
    listing = json.loads(run("ls", "runs/r1", "--json"))
    assert [r["ref"] for r in listing] == [
        "runs/r1/latest",
        "runs/r1/phase1/ckpt_phase1_step00000100",
        "runs/r1/phase1/ckpt_phase1_step00000200",
    ]
    assert listing[1]["meta"]["step"] == 100
    assert json.loads(run("ls", "runs/*/phase1/**", "--json"))[0]["ref"].endswith("00000100")
    shown = json.loads(run("show", "runs/r1/latest", "--json"))
    assert shown["meta"]["step"] == 200 and any(
        t["path"] == "model.0.weight" for t in shown["tensors"]
    )
    log = json.loads(run("log", "runs/r1/latest", "--json"))
    assert len(log) == 2 and log[1]["manifest"] == repo.resolve("runs/r1/latest~1")
    changes = json.loads(
        run(
            "diff",
            "runs/r1/phase1/ckpt_phase1_step00000100",
            "runs/r1/phase1/ckpt_phase1_step00000200",
            "--json",
        )
    )
    assert {c["path"] for c in changes} == {"model.0.bias"}
    run("cp", "runs/r1/latest", "gates/bc_best")
    assert repo.resolve("gates/bc_best") == repo.resolve("runs/r1/latest")
    run("rm", "runs/r1/latest")
    run("show", "runs/r1/latest", ok=False)
    assert "ok:" in run("verify", "--full")


def test_verify_exits_non_zero_on_a_missing_chunk(run: StoreCLI, tmp_path: Path) -> None:
    repo = cas.open(run.store)
    repo.save({"w": torch.randn(4096)}, "runs/v")
    digest = repo.manifest("runs/v").tensors[0].chunks[0].digest
    (run.store / "chunks" / digest[:2] / digest).unlink()
    output = run("verify", "--json", ok=False)
    report = json.loads(output)
    assert not report["ok"] and report["problems"][0]["kind"] == "missing-chunk"
