"""Bounded readers: a stored document costs memory in proportion to its size, whatever it declares.

The story of issue 26: a manifest whose ``meta`` is millions of empty msgpack arrays (876 bytes
stored) cost 3.36 GB and 130 s in each of ``show``, ``ls -l``, ``gc`` and ``verify``; a ref whose
record lists one sealed history segment 200,000 times made ``cas log`` read 12.8 million events.
Every command now answers within 100 MB of RSS, and the decoders refuse before they allocate.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import pytest

import cas
from cas.digest import digest_of
from cas.errors import FormatError
from cas.model.bounded import (
    DECODE_FLOOR,
    MAX_AMPLIFICATION,
    measure,
    share_digest_lists,
    unpack_bounded,
)
from cas.model.manifest import ChunkRef, Manifest, TensorEntry, decode_manifest, encode_manifest
from cas.refs.maintenance import parse_lock
from cas.refs.records import MAX_STORED_HISTORY
from cas.refs.sweeps import SWEEP_KEY, read_sweep
from tests import hostile
from tests.hostile import HOSTILE_REF, tensor_leaf
from tests.test_hostile_stores import measured

RSS_BOUND = 100 << 20
"""Peak RSS any command may reach on a hostile store (the issue's must-show)."""


def every_command(store: Path) -> dict[str, list[str]]:
    """The commands of the story, each run as ``cas --store STORE ...``."""
    cli = [sys.executable, "-m", "cas", "--store", str(store)]
    return {
        name: [*cli, *args]
        for name, args in {
            "show": ["show", HOSTILE_REF],
            "ls -l": ["ls", "-l"],
            "gc": ["gc"],
            "verify": ["verify"],
            "log": ["log", HOSTILE_REF],
            "status": ["status"],
            "forget --dry-run": ["forget", "--dry-run", "--select", "runs/**", "--keep-last", "1"],
        }.items()
    }


def assert_bounded_answer(name: str, rc: int, stderr: str, peak: int) -> None:
    """No traceback, each problem in one line on stderr (``status`` names a damaged ref once for
    its listing and once for its GC plan), and a peak RSS under ``RSS_BOUND``."""
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, f"{name}:\n{stderr[-3000:]}"
    assert len(lines) <= 2, f"{name}:\n{stderr[-3000:]}"
    assert all(line.startswith(("cas: ", "PROBLEM ")) for line in lines), f"{name}: {lines}"
    assert rc in (0, 1), f"{name} exited {rc}: {stderr[-3000:]}"
    assert peak < RSS_BOUND, f"{name} peaked at {peak >> 20} MiB"


@pytest.mark.parametrize("width", [0, 15], ids=["one array", "arrays of fifteen"])
def test_876_bytes_of_empty_lists_in_meta_cost_every_command_under_100_mb(
    tmp_path: Path, width: int
) -> None:
    store = tmp_path / "store"
    hostile.empty_lists_meta(store, width=width)
    stored = [p.stat().st_size for p in (store / "manifests").rglob("*") if p.is_file()]
    assert max(stored) == 876 if not width else max(stored) < 4096  # bytes for 23 million lists
    for name, command in every_command(store).items():
        rc, stderr, peak = measured(*command)
        assert_bounded_answer(name, rc, stderr, peak)
    rc, stderr, _ = measured(*every_command(store)["show"])
    assert rc == 1 and "manifest would take at least" in stderr and "limit of 32.0 MiB" in stderr


def test_a_ref_listing_one_segment_200k_times_logs_only_the_history_a_ref_keeps(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    hostile.repeated_segment(store)
    for name, command in every_command(store).items():
        rc, stderr, peak = measured(*command)
        assert_bounded_answer(name, rc, stderr, peak)
    with cas.open(store, readonly=True) as repo:
        record = repo.find_ref(HOSTILE_REF)
        assert record is not None and len(record.sealed) == 1
        assert record.ignored_history == 64 * (200_000 - 1)
        assert len(repo.log(HOSTILE_REF)) <= MAX_STORED_HISTORY
    rc, stderr, _ = measured(*every_command(store)["log"])
    assert rc == 1 and "12799936 more events" in stderr


def test_the_next_change_of_a_ref_drops_its_repeated_segments(tmp_path: Path) -> None:
    store = tmp_path / "store"
    hostile.repeated_segment(store, times=1000)
    with cas.open(store) as repo:
        depth = len(repo.log(HOSTILE_REF))
        repo.set_ref(HOSTILE_REF, repo.save({"step": 9}, "runs/other"))
        record = repo.find_ref(HOSTILE_REF)
        assert record is not None and record.ignored_history == 0
        assert len(repo.log(HOSTILE_REF)) == depth + 1


def _empty_lists(count: int, width: int) -> bytes:
    group = bytes([0x90 + width]) + b"\x90" * width
    return b"\xdd" + (count // width).to_bytes(4, "big") + group * (count // width)


def test_a_document_over_its_budget_is_refused_before_anything_is_allocated() -> None:
    data = _empty_lists(20_000_000, 15)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=r"manifest would take at least .* limit of 32"):
            unpack_bounded(data, "manifest", max_depth=8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


UNPACK_TRACED = """
import sys, tracemalloc, msgpack
data = sys.stdin.buffer.read()
tracemalloc.start()
decoded = msgpack.unpackb(data, strict_map_key=False)
print(tracemalloc.get_traced_memory()[0])
"""
"""Bytes still allocated after unpacking the document on stdin (the decoded value's)."""


@pytest.mark.parametrize(
    "value",
    [
        [[] for _ in range(60_000)],
        [{0: {}} for _ in range(30_000)],
        [{"k": [-100, "ab"]} for _ in range(30_000)],
        [[1.5, -7, "xyz" * 3, b"\x00\x01\x02"] for _ in range(30_000)],
        {f"key{i}": [i, i * 1.5, None, True] for i in range(30_000)},
    ],
    ids=["empty lists", "maps of maps", "small scalars", "mixed", "a wide map"],
)
def test_what_measure_charges_is_at_least_what_unpacking_takes(value: Any) -> None:
    data = msgpack.packb(value)
    charged = measure(data, "document", budget=1 << 40, max_depth=8)
    # Unpacked in an interpreter of its own: in a test worker the same call was traced at
    # 14.7 MB once, against 6.9-8.9 MB in a fresh process (what earlier tests left in the
    # allocator's free lists and other threads changes what tracemalloc sees).
    taken = subprocess.run(
        [sys.executable, "-c", UNPACK_TRACED], input=data, capture_output=True, check=True
    ).stdout
    assert msgpack.unpackb(data, strict_map_key=False) == value
    assert 0 < int(taken) <= charged


def test_a_chunk_named_a_million_times_is_charged_once(tmp_path: Path) -> None:
    pair = [os.urandom(32), 8]
    data = msgpack.packb({"chunks": [pair] * 1_000_000})
    charged = measure(data, "manifest", budget=1 << 40, max_depth=8, share=bytes)
    assert charged < DECODE_FLOOR  # the slots, not a million lists
    doc = msgpack.unpackb(data, list_hook=share_digest_lists(bytes))
    assert all(item is doc["chunks"][0] for item in doc["chunks"])


def test_a_repeated_nan_is_not_taken_for_a_shared_list() -> None:
    item = msgpack.packb([os.urandom(32), float("nan")])
    data = b"\xdd" + (200_000).to_bytes(4, "big") + item * 200_000
    with pytest.raises(FormatError, match="would take at least"):
        measure(data, "manifest", budget=8 << 20, max_depth=8, share=bytes)


def test_nesting_deeper_than_a_document_allows_is_one_named_line() -> None:
    deep = b"\x91" * 400 + b"\x00"
    with pytest.raises(FormatError, match="manifest nests deeper than 300 levels"):
        measure(deep, "manifest", budget=1 << 30, max_depth=300)
    too_deep = b"\x91" * 5000 + b"\x00"  # small enough not to be measured: msgpack's stack stops it
    with pytest.raises(FormatError, match=r"^ref 'x' nests deeper than msgpack reads$"):
        unpack_bounded(too_deep, "ref 'x'", max_depth=8)


def test_malformed_msgpack_always_says_what_is_wrong() -> None:
    for data in (b"\xc1", b"\x92\x01", b"\x91\x01\x02", b"\xa2\xff\xfe", b"\x91" * 5000):
        with pytest.raises(FormatError, match=r"^manifest \S.*\S$"):
            unpack_bounded(data, "manifest", max_depth=8)


def test_a_large_real_manifest_still_decodes() -> None:
    count = 40_000
    chunks = tuple(ChunkRef(digest_of(i.to_bytes(4, "big")), 64) for i in range(count))
    tensor = TensorEntry("torch", "uint8", (64 * count,), 64 * count, chunks)
    meta = {"losses": [i * 0.5 for i in range(50_000)], "names": [f"layer.{i}" for i in range(9)]}
    manifest = Manifest(
        "state", (tensor,), {"~": "dict", "items": [["w", tensor_leaf(0)]]}, meta=meta
    )
    data = encode_manifest(manifest)
    assert len(data) * MAX_AMPLIFICATION > DECODE_FLOOR  # large enough to be measured
    assert decode_manifest(data) == manifest


def test_a_lock_or_sweep_record_nested_100k_deep_reads_as_unreadable_not_a_crash(
    tmp_path: Path,
) -> None:
    nested = b"[" * 100_000 + b"]" * 100_000
    assert parse_lock(nested) is None
    with cas.open(tmp_path / "store") as repo:
        repo.blobs.put(SWEEP_KEY, nested)
        assert read_sweep(repo.blobs).sweeping  # unreadable: taken as a batch in progress


def test_a_store_config_nested_100k_deep_is_one_line(tmp_path: Path) -> None:
    cas.open(tmp_path / "store").close()
    (tmp_path / "store" / "config").write_bytes(b"[" * 100_000)
    rc, stderr, _ = measured(sys.executable, "-m", "cas", "--store", str(tmp_path / "store"), "ls")
    assert rc == 1 and stderr.strip() == (
        "cas: error: FormatError: store config nests deeper than a record can"
    )
