"""A store's settings live in the store: opening it with others says so, and they change on purpose."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cas
from cas.errors import AlreadyExists
from cas.repo.config import StoreConfig
from tests.helpers import run_cli


def test_opening_an_existing_store_with_other_settings_names_them_instead_of_ignoring_them(
    tmp_path: Path,
) -> None:
    cas.open(tmp_path / "store", config=StoreConfig(chunk_size=64 << 10)).close()
    asked = StoreConfig(chunk_size=16 << 10, codec="zstd", extra={"gc": {"grace": 0}})
    with pytest.raises(AlreadyExists) as refused:
        cas.open(tmp_path / "store", config=asked)
    message = str(refused.value)
    assert "\n" not in message
    assert "chunk_size 65536 (asked 16384)" in message
    assert "codec 'raw' (asked 'zstd')" in message
    assert "extra section 'gc'" in message
    assert "update_settings" in message and "fixed at creation" in message
    assert cas.open(tmp_path / "store").config.chunk_size == 64 << 10  # nothing changed


def test_reopening_with_the_settings_it_was_made_with_is_fine(tmp_path: Path) -> None:
    config = StoreConfig(chunk_size=16 << 10, inline_max=64)
    repo = cas.open(tmp_path / "store", config=config)
    repo.store_gc_settings(repo.gc_settings())  # sections the opener does not name: not compared
    cas.open(tmp_path / "store", config=config).close()
    cas.open(tmp_path / "store", config=repo.config).close()


def test_the_codec_is_changed_on_purpose_for_every_later_write(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    repo.update_settings(codec="zstd", compression_level=5)
    reopened = cas.open(tmp_path / "store", config=StoreConfig(codec="zstd", compression_level=5))
    digest = reopened.save({"w": torch.zeros(1 << 16)}, "runs/r1/ckpt")
    stored = sum(info.size for info in reopened.blobs.list_info("chunks/"))
    assert stored < 4096 and reopened.manifest(digest).tensors[0].nbytes == 1 << 18
    with pytest.raises(ValueError, match="chunk_size cannot be changed"):
        repo.update_settings(chunk_size=8192)
    with pytest.raises(Exception, match="nosuch"):
        repo.update_settings(codec="nosuch")
    assert cas.open(tmp_path / "store").config.codec == "zstd"


def test_pushing_to_an_existing_store_with_other_settings_keeps_its_settings(
    tmp_path: Path,
) -> None:
    local = cas.open(tmp_path / "local", config=StoreConfig(chunk_size=16 << 10))
    local.save({"w": torch.ones(1 << 14)}, "runs/r1/ckpt")
    cas.open(tmp_path / "archive", config=StoreConfig(codec="zstd")).close()
    pushed = run_cli(tmp_path / "local", "push", "runs/r1/ckpt", "--to", str(tmp_path / "archive"))
    assert pushed.returncode == 0, pushed.stderr
    archive = cas.open(tmp_path / "archive")
    assert archive.config.codec == "zstd" and archive.config.chunk_size == 4 << 20
    assert torch.equal(archive.load("runs/r1/ckpt")["w"], torch.ones(1 << 14))
