"""The benchmarks' peers. Compression: each peer stores the checkpoints and loads the newest back,
or the benchmark says why it left that peer out; none can fail the run by being absent. Manager:
DCP's async_save and torch.save really checkpoint the loop the manager is measured on."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import save_file

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses in it look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    return script("compression_peers")


def training_run(root: Path) -> list[Path]:
    """Two checkpoints of a small AdamW run as ``ckpt.pt``, then a safetensors export."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dirs = []
    for step in (1, 2):
        loss = model(torch.randn(8, 64)).pow(2).mean()
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()
        directory = root / f"step_{step}"
        directory.mkdir(parents=True)
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict()}, directory / "ckpt.pt"
        )
        dirs.append(directory)
    export = root / "export"
    export.mkdir()
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(export / "model.safetensors"))
    (export / "config.json").write_text('{"width": 64}')
    return [*dirs, export]


@pytest.mark.slow
def test_every_peer_stores_the_run_and_loads_the_newest_or_says_why_not(
    peers: ModuleType, tmp_path: Path
) -> None:
    dirs = training_run(tmp_path / "files")
    rows = peers.peer_rows(dirs, dirs[1], tmp_path, "run", archivers=True, repeat=1)
    assert list(rows) == ["files", "zipnn", "borg", "restic"]
    assert rows["files"]["ratio"] == pytest.approx(1.0)
    for peer, row in rows.items():
        if isinstance(row, str):
            assert row.startswith("not installed"), (peer, row)
            continue
        assert row["stored_bytes"] > 0 and row["seconds"] > 0, peer
        assert row["newest_load_s"] > 0 and math.isfinite(row["ingest_mb_s"]), peer


def test_a_missing_archiver_or_zipnn_is_a_note_not_a_failure(
    peers: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs = training_run(tmp_path / "files")
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setitem(sys.modules, "zipnn", None)  # import zipnn raises ImportError
    rows = peers.peer_rows(dirs, dirs[-1], tmp_path, "run", archivers=True, repeat=1)
    assert rows["zipnn"].startswith("not installed")
    assert rows["borg"] == "not installed (apt-get install borgbackup)"
    assert rows["restic"] == "not installed (apt-get install restic)"
    assert isinstance(rows["files"], dict)


def test_quick_runs_leave_the_archivers_out_with_a_note(peers: ModuleType, tmp_path: Path) -> None:
    dirs = training_run(tmp_path / "files")
    rows = peers.peer_rows(dirs, dirs[-1], tmp_path, "run", archivers=False, repeat=1)
    assert rows["borg"] == rows["restic"] == "skipped (--quick)"


def test_the_load_check_compares_bits_so_a_wrong_load_cannot_pass(peers: ModuleType) -> None:
    signed = torch.tensor([0.0, 1.0])
    assert not peers.same_state({"w": signed}, {"w": torch.tensor([-0.0, 1.0])})
    nan = torch.tensor([float("nan"), 2.0])
    assert peers.same_state({"w": nan}, {"w": nan.clone()})
    assert not peers.same_state({"w": signed}, {"w": signed.to(torch.float64)})
    assert not peers.same_state({"step": 1}, {"step": 2})


def test_the_manager_bench_checkpoints_the_same_loop_with_cas_dcp_and_torch_save(
    tmp_path: Path,
) -> None:
    from torch.distributed.checkpoint import state_dict_loader

    bench = script("bench_manager")
    rows = bench.peer_windows(width=32, batch=4, every=2, root=tmp_path, rounds=2)
    for saver in ("cas", "dcp_async_save", "torch_save_sync"):
        assert set(rows[saver]) >= {"overhead_pct", "overhead_pct_ci95", "overhead_ms"}, saver
    assert isinstance(rows["cas_at_or_below_peers"], bool)
    # One warm-up window and two rounds: three saves each, and the last of them loads back.
    saves = tmp_path / "peers-4"
    assert sorted(p.name for p in (saves / "peers-torch").iterdir())[-1] == "step_9.pt"
    last_dcp = saves / "peers-dcp" / "step_8"
    untrained = bench.build(32)[0].state_dict()
    state = {"model": bench.build(32)[0].state_dict()}
    state_dict_loader.load(state, checkpoint_id=last_dcp, no_dist=True)
    assert not torch.equal(state["model"]["0.weight"], untrained["0.weight"])
