"""`cas show` and `cas diff` see the tensors inside ingested .pt and .safetensors files: every
tensor with its dtype, shape and size, small ones included, and two checkpoints compared tensor
by tensor (from their manifests: chunk lists, and the inline bytes of small tensors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import cas
from cas.cli import cli
from cas.repo.config import StoreConfig


def cas_json(store: Path, *args: str) -> Any:
    result = CliRunner().invoke(cli, ["--store", str(store), *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def stored(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    cas.open(store, config=StoreConfig(chunk_size=16 << 10))
    return store


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "fc.weight": torch.randn(128, 64, generator=generator),  # 32 KiB: chunked
        "fc.bias": torch.randn(128, generator=generator),  # 512 B: small, inline
        "norm.scale": torch.ones(16, dtype=torch.bfloat16),
    }


def test_cas_show_of_an_ingested_pt_lists_every_tensor_small_ones_too(tmp_path: Path) -> None:
    store = stored(tmp_path)
    torch.save({"model": weights(0), "step": torch.tensor(7)}, tmp_path / "ckpt.pt")
    cas.open(store).put_path(tmp_path / "ckpt.pt", "runs/a/ckpt")

    table = {t["path"]: t for t in cas_json(store, "show", "runs/a/ckpt")["tensors"]}

    assert set(table) == {
        "ckpt.pt:model.fc.weight", "ckpt.pt:model.fc.bias", "ckpt.pt:model.norm.scale",
        "ckpt.pt:step",
    }  # fmt: skip
    assert (table["ckpt.pt:model.fc.bias"]["dtype"], table["ckpt.pt:model.fc.bias"]["shape"]) == (
        "float32",
        [128],
    )
    assert table["ckpt.pt:model.norm.scale"]["dtype"] == "bfloat16"
    assert (table["ckpt.pt:step"]["shape"], table["ckpt.pt:step"]["nbytes"]) == ([], 8)
    assert table["ckpt.pt:model.fc.weight"]["nbytes"] == 128 * 64 * 4


def test_cas_show_of_an_ingested_safetensors_file_lists_every_tensor(tmp_path: Path) -> None:
    store = stored(tmp_path)
    save_file(weights(0), tmp_path / "model.safetensors")
    cas.open(store).put_path(tmp_path / "model.safetensors", "hf/model")

    rows = cas_json(store, "show", "hf/model")["tensors"]

    assert sorted((r["path"], r["dtype"], r["shape"]) for r in rows) == [
        ("model.safetensors:fc.bias", "float32", [128]),
        ("model.safetensors:fc.weight", "float32", [128, 64]),
        ("model.safetensors:norm.scale", "bfloat16", [16]),
    ]


def test_a_small_tensor_of_an_ingested_file_is_described_with_its_exact_bytes(
    tmp_path: Path,
) -> None:
    store = stored(tmp_path)
    state = weights(3)
    save_file(state, tmp_path / "model.safetensors")
    repo = cas.open(store)
    repo.put_path(tmp_path / "model.safetensors", "hf/model")
    manifest = repo.manifest("hf/model")
    entry = manifest.files["model.safetensors"]
    small = next(r for r in entry.regions if r.name == "fc.bias")
    assert manifest.tensors[small.tensor_index].inline == state["fc.bias"].numpy().tobytes()


def test_cas_diff_of_two_ingested_pt_files_compares_them_tensor_by_tensor(tmp_path: Path) -> None:
    store = stored(tmp_path)
    repo = cas.open(store)
    before = weights(0)
    after = {**before, "fc.bias": before["fc.bias"] + 1, "head.weight": torch.zeros(4, 64)}
    del after["norm.scale"]
    torch.save({"model": before}, tmp_path / "step100.pt")
    torch.save({"model": after}, tmp_path / "step200.pt")
    repo.put_path(tmp_path / "step100.pt", "runs/a/step100")
    repo.put_path(tmp_path / "step200.pt", "runs/a/step200")

    rows = cas_json(store, "diff", "runs/a/step100", "runs/a/step200", "--all")
    tensors = {r["path"]: r["change"] for r in rows if r["kind"] == "tensor"}

    assert tensors == {
        "step200.pt:model.fc.weight": "same",
        "step200.pt:model.fc.bias": "changed",
        "step200.pt:model.head.weight": "added",
        "step200.pt:model.norm.scale": "removed",
    }
    assert [r["change"] for r in rows if r["kind"] == "file"] == ["changed"]
    only_changes = cas_json(store, "diff", "runs/a/step100", "runs/a/step200")
    assert "step200.pt:model.fc.weight" not in {r["path"] for r in only_changes}


def test_cas_diff_of_two_safetensors_checkpoints_reports_a_retyped_tensor(tmp_path: Path) -> None:
    store = stored(tmp_path)
    repo = cas.open(store)
    before = weights(0)
    after = {**before, "fc.weight": before["fc.weight"].to(torch.bfloat16)}
    for name, state in (("v1", before), ("v2", after)):
        (tmp_path / name).mkdir()
        save_file(state, tmp_path / name / "model.safetensors")
        repo.put_path(tmp_path / name, f"hf/{name}")

    rows = cas_json(store, "diff", "hf/v1", "hf/v2")

    assert {r["path"]: r["change"] for r in rows if r["kind"] == "tensor"} == {
        "model.safetensors:fc.weight": "retyped"
    }


def test_a_safetensors_file_written_through_cas_urls_lists_its_small_tensors_like_cas_put(
    tmp_path: Path,
) -> None:
    import fsspec
    from safetensors.torch import save

    store = stored(tmp_path)
    repo = cas.open(store)
    data = save(weights(0))
    with fsspec.open("cas://hf/streamed/model.safetensors", "wb", repo=repo) as f:
        for start in range(0, len(data), 1000):  # arrives in pieces, as a writer sends it
            f.write(data[start : start + 1000])
    (tmp_path / "model.safetensors").write_bytes(data)
    repo.put_path(tmp_path / "model.safetensors", "hf/put")

    streamed = cas_json(store, "show", "hf/streamed")["tensors"]
    put = cas_json(store, "show", "hf/put")["tensors"]
    assert sorted(t["path"] for t in streamed) == sorted(t["path"] for t in put)
    assert len(streamed) == 3
    assert cas_json(store, "diff", "hf/streamed", "hf/put") == []
