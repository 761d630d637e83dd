"""Hostile and damaged stores: every command ends in one line, and a reader's memory stays bounded.

Each store is crafted below the API (``tests.hostile``); commands run in a child process whose
peak RSS is measured after it exits, with an address-space cap so a regression fails the test
instead of the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import cas
from cas.errors import FormatError
from tests import hostile
from tests.hostile import HOSTILE_REF, one_tensor, plant_manifest, state_doc

MEMORY_BOUND = 1 << 30
"""Peak RSS a command may reach on any of these stores (torch alone takes about 250 MiB)."""

_MEASURE = """
import json, resource, subprocess, sys
def cap():
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
child = subprocess.run(sys.argv[1:], capture_output=True, text=True, preexec_fn=cap)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"rc": child.returncode, "stderr": child.stderr, "peak": peak}))
"""

_LOAD = """
import sys, cas
try:
    state = cas.open(sys.argv[1], readonly=True).load(sys.argv[2])
except cas.CASError as e:
    sys.exit(f"cas: error: {type(e).__name__}: {e}")
print(sum(t.numel() for t in state.values() if hasattr(t, "numel")))
"""


def measured(*command: str) -> tuple[int, str, int]:
    """Run ``command`` in a child process: its exit code, stderr and peak RSS in bytes."""
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *command],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout)
    return result["rc"], result["stderr"], result["peak"]


def commands(store: Path, dest: Path) -> dict[str, list[str]]:
    """The reading commands of the story: get, show, verify --full, and Repository.load."""
    cli = [sys.executable, "-m", "cas", "--store", str(store)]
    return {
        "get": [*cli, "get", HOSTILE_REF, str(dest)],
        "show": [*cli, "show", HOSTILE_REF],
        "verify": [*cli, "verify", "--full"],
        "load": [sys.executable, "-c", _LOAD, str(store), HOSTILE_REF],
    }


def assert_one_line_refusal(name: str, rc: int, stderr: str, peak: int) -> None:
    lines = stderr.strip().splitlines()
    assert rc != 0, f"{name} succeeded"
    assert "Traceback" not in stderr, f"{name}:\n{stderr[-3000:]}"
    assert len(lines) == 1, f"{name}:\n{stderr[-3000:]}"
    assert lines[0].startswith(("cas: error:", "PROBLEM ")), f"{name}: {lines[0]}"
    assert peak < MEMORY_BOUND, f"{name} peaked at {peak >> 20} MiB"


MANIFEST_DEFECTS: dict[str, Callable[[Path], None]] = {
    "a 2**40-element tensor": hostile.huge_tensor,
    "a shape whose product overflows": hostile.overflowing_shape,
    "a numpy shape that does not match its bytes": hostile.numpy_shape_mismatch,
    "a 490-deep tree": hostile.deep_tree,
    "a 5,000-digit int": hostile.huge_int,
    "a tensor index out of range": hostile.tensor_index_out_of_range,
    "items that are not a list": hostile.items_not_a_list,
    "a device that is no device": hostile.bad_device,
}


@pytest.mark.parametrize("defect", MANIFEST_DEFECTS)
def test_a_hostile_manifest_is_one_line_from_every_reading_command(
    tmp_path: Path, defect: str
) -> None:
    store = tmp_path / "store"
    MANIFEST_DEFECTS[defect](store)
    for name, command in commands(store, tmp_path / "out").items():
        rc, stderr, peak = measured(*command)
        assert_one_line_refusal(name, rc, stderr, peak)
        assert "FormatError" in stderr or "corrupt-manifest" in stderr, stderr
    assert not (tmp_path / "out").exists()


def test_two_chunks_that_are_each_others_delta_base_are_refused_before_decoding(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    hostile.delta_cycle(store)
    stored = sum(p.stat().st_size for p in (store / "chunks").rglob("*") if p.is_file())
    assert stored < 16 << 10  # a few KB that claim 64 MiB at every level of a 64-deep chain
    runs = commands(store, tmp_path / "out")
    for name in ("get", "verify", "load"):
        rc, stderr, peak = measured(*runs[name])
        if name == "verify":
            # The manifest lists neither base, which verify reports on a line of its own.
            unlisted = [line for line in stderr.splitlines() if "unlisted-base" in line]
            assert len(unlisted) == 1, stderr
            stderr = stderr.replace(unlisted[0], "")
        assert_one_line_refusal(name, rc, stderr, peak)
        assert "delta chain loops" in stderr
    rc, stderr, peak = measured(*runs["show"])  # reads the manifest alone, which is sound
    assert rc == 0 and not stderr and peak < MEMORY_BOUND


def test_one_small_chunk_named_a_million_times_costs_what_the_tensor_returned_costs(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    hostile.repeated_chunk(store)
    runs = commands(store, tmp_path / "out")
    for name, command in runs.items():
        rc, stderr, peak = measured(*command)
        assert rc == 0, f"{name}: {stderr[-3000:]}"
        assert peak < MEMORY_BOUND // 2, f"{name} peaked at {peak >> 20} MiB"
    restored = torch.load(tmp_path / "out", weights_only=True)
    assert torch.equal(restored["w"][:16], torch.arange(8, dtype=torch.uint8).repeat(2))
    assert restored["w"].numel() == 8 * 1_500_000


def test_a_device_this_torch_does_not_know_is_a_format_error(tmp_path: Path) -> None:
    store = tmp_path / "store"
    plant_manifest(store, state_doc({"~": "dict", "items": [["d", {"~": "device", "v": "warp"}]]}))
    with cas.open(store) as repo, pytest.raises(FormatError, match="unknown device 'warp'"):
        repo.load(HOSTILE_REF)


def test_a_chunk_listed_with_two_sizes_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    digest = hostile.plant_chunk(store, bytes(64))
    entry = {"kind": "torch", "dtype": "uint8", "shape": [96], "nbytes": 96}
    plant_manifest(store, one_tensor({**entry, "chunks": [[digest, 64], [digest, 32]]}))
    with cas.open(store) as repo, pytest.raises(FormatError, match="listed as 64 and 32"):
        repo.load(HOSTILE_REF)


def test_a_reader_refuses_a_checkpoint_declaring_more_than_its_limits(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with cas.open(store) as repo:
        repo.save({"a": torch.zeros(1 << 18), "b": torch.zeros(1 << 18)}, "runs/big")
    with cas.open(store, read_limits=cas.ReadLimits(max_checkpoint_bytes=1 << 20)) as repo:
        with pytest.raises(FormatError, match="above the reader's limit"):
            repo.load("runs/big")
        assert repo.load("runs/big", keys="a")["a"].numel() == 1 << 18
    limits = cas.ReadLimits(max_tensor_bytes=1 << 19)
    with cas.open(store, read_limits=limits) as repo, pytest.raises(FormatError, match=r"1\.0 MiB"):
        repo.load("runs/big")
    env = {"CAS_MAX_CHECKPOINT_BYTES": "1M", "PATH": "/usr/bin:/bin"}
    cli = [sys.executable, "-m", "cas", "--store", str(store), "get", "runs/big"]
    result = subprocess.run(
        [*cli, str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120
    )
    assert_one_line_refusal("get", result.returncode, result.stderr, 0)
    assert "CAS_MAX_CHECKPOINT_BYTES" in result.stderr


def test_ints_shapes_and_trees_at_their_limits_still_load(tmp_path: Path) -> None:
    tree: Any = {"~": "int", "v": "-" + "9" * 4300}
    for _ in range(99):
        tree = {"~": "list", "items": [tree]}
    entry = {"kind": "numpy", "dtype": "<U3", "shape": [2, 0], "nbytes": 0, "inline": b""}
    doc = one_tensor(entry)
    doc["tree"]["items"].append(["deep", tree])
    store = tmp_path / "store"
    plant_manifest(store, doc)
    with cas.open(store) as repo:
        state = repo.load(HOSTILE_REF)
    assert state["w"].shape == (2, 0) and str(state["w"].dtype) == "<U3"
    node = state["deep"]
    for _ in range(99):
        node = node[0]
    assert node == -int("9" * 4300)
    assert msgpack.packb(doc)  # the document is what a writer could produce
