"""Streaming cuts: a file cut as it streams in gets exactly the chunks ``put_path`` gives it."""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from cas.formats import inspect_file
from cas.objects.chunking import layout_cuts
from cas.objects.streamcut import StreamCutter

CHUNK, CDC_AVG, INLINE_MAX = 64 << 10, 16 << 10, 256


def streamed(
    data: bytes, seed: int, max_piece: int
) -> tuple[list[tuple[int, int, bool]], StreamCutter]:
    cuts: list[tuple[int, int, bool]] = []
    cutter = StreamCutter(
        lambda c, b, r: cuts.append((c.offset, c.size, r is not None)), CHUNK, CDC_AVG, INLINE_MAX
    )
    rng, position = random.Random(seed), 0
    while position < len(data):
        step = rng.randint(1, max_piece)
        cutter.write(data[position : position + step])
        position += step
    cutter.finish()
    return cuts, cutter


def whole_file(path: Path) -> list[tuple[int, int, bool]]:
    data = path.read_bytes()
    regions = [(r.offset, r.nbytes) for r in inspect_file(path).regions if r.nbytes > INLINE_MAX]
    return [
        (c.offset, c.size, i is not None)
        for c, i in layout_cuts(memoryview(data), regions, CHUNK, CDC_AVG)
    ]


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a": torch.randn(100_000),
        "b": torch.randn(10),
        "c": torch.randn(300, 300).half(),
        "d": torch.arange(50_000),
    }


@pytest.mark.parametrize("kind", ["safetensors", "torch-zip", "opaque", "tiny"])
@pytest.mark.parametrize("max_piece", [7, 1000, 100_000, 10**8])
def test_streamed_cuts_equal_whole_file_cuts(tmp_path: Path, kind: str, max_piece: int) -> None:
    path = tmp_path / f"file.{kind}"
    if kind == "safetensors":
        path.write_bytes(save(tensors()))
    elif kind == "torch-zip":
        torch.save(tensors(), path)
    else:
        path.write_bytes(os.urandom(3 << 20) if kind == "opaque" else b"abc")
    cuts, cutter = streamed(path.read_bytes(), max_piece, max_piece)
    assert cuts == whole_file(path)
    assert cutter.format == inspect_file(path).format
    assert sum(size for _, size, _ in cuts) == path.stat().st_size


def test_concatenated_torch_zips_are_cut_at_every_storage(tmp_path: Path) -> None:
    """DCP ``.distcp`` files are ``torch.save`` zips laid end to end."""
    parts = []
    for name, tensor in tensors().items():
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        parts.append((name, tensor, buffer.getvalue()))
    data = b"".join(blob for _, _, blob in parts)
    _, cutter = streamed(data, 0, 5000)
    big = [t for _, t, _ in parts if t.numel() * t.element_size() > INLINE_MAX]
    assert len(cutter.regions) == len(big)
    for region, tensor in zip(cutter.regions, big, strict=True):
        assert region.end is not None
        assert (
            data[region.start : region.end]
            == tensor.contiguous().view(torch.uint8).numpy().tobytes()
        )


def test_a_truncated_safetensors_stream_still_covers_every_byte() -> None:
    data = save(tensors())[:-1000]
    cuts, cutter = streamed(data, 1, 4096)
    assert sum(size for _, size, _ in cuts) == len(data)
    assert [c[0] for c in cuts] == sorted(c[0] for c in cuts)
    complete = cutter.complete_tensors()
    assert all(t.end <= len(data) for t in complete)
    assert len(complete) == 2  # of three large tensors, the one cut short is not recorded
