"""Delta checkpoints: smaller stores, bounded chains, bases kept alive from manifests alone."""

from __future__ import annotations

import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import cas
from cas.cli import cli
from cas.codecs import EncodeHints, codec_by_name
from cas.digest import Digest
from cas.objects.recode import recode_chunk, recode_manifest
from cas.objects.store import ObjectStore, PutResult, chunk_key
from cas.repo.config import StoreConfig
from cas.retention.gc import GCSettings
from tests.helpers import assert_bit_exact, local_root

CHUNK = 16 << 10
DELTA_CODECS = ("xor-shuffle-zstd", "sub-shuffle-zstd")
"""What ``codec="auto"`` writes deltas with."""


def delta_repo(
    root: Path, max_depth: int = 8, codec: str = "auto", anchor: str = "parent"
) -> cas.Repository:
    """A store with small chunks; deltas chain against the parent unless ``anchor`` says not."""
    extra = {"delta": {"max_depth": max_depth, "anchor": anchor}}
    return cas.open(
        root, config=StoreConfig(chunk_size=CHUNK, inline_max=256, codec=codec, extra=extra)
    )


def training_states(count: int, width: int = 96, seed: int = 0) -> list[dict[str, Any]]:
    """Snapshots of a real model + AdamW state, a few optimizer steps apart."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width * 2), torch.nn.GELU(), torch.nn.Linear(width * 2, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    states = []
    for _ in range(count):
        for _ in range(3):
            model(torch.randn(32, width)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        snapshot = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        states.append(_clone(snapshot))
    return states


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def tensor_encodings(repo: cas.Repository, ref: str) -> dict[str, dict[str, Any]]:
    from cas.model.state import iter_tensor_paths

    manifest = repo.manifest(ref)
    return {p: manifest.tensors[i].encoding or {} for p, i in iter_tensor_paths(manifest.tree)}


def collect_garbage(repo: cas.Repository) -> int:
    """Run the real GC (``plan_gc``, then ``execute``) with no grace period and no history
    window, so it keeps exactly what the current refs' manifests name, delta bases included;
    return how many chunks it deleted.

    GC's clock runs two seconds ahead of the store's: objects written a moment ago would
    otherwise share the plan's clock tick (S3 counts whole seconds) and be kept as young.
    """
    plan = repo.plan_gc(GCSettings(grace=0, reflog_window=0), clock=lambda: time.time() + 2)
    assert not plan.live_leases and not plan.broken_refs
    return plan.execute().deleted_chunks


def test_consecutive_checkpoints_are_stored_as_deltas_and_load_bit_exact(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s")
    states = training_states(4)
    for state in states:
        repo.save(state, "runs/r1/latest")
    weight = tensor_encodings(repo, "runs/r1/latest")["model.0.weight"]
    assert weight["codec"] in DELTA_CODECS
    assert weight["depth"] == 3 and len(weight["base"]) >= 3
    for back, state in enumerate(reversed(states)):
        assert_bit_exact(repo.load(f"runs/r1/latest~{back}"), state)
    raw = delta_repo(tmp_path / "raw", codec="raw")
    for state in states:
        raw.save(state, "runs/r1/latest")
    ratio = repo.stored_bytes(_all_chunks(repo)) / raw.stored_bytes(_all_chunks(raw))
    assert ratio < 0.85


def _all_chunks(repo: cas.Repository) -> list[Digest]:
    return [Digest(key.rsplit("/", 1)[-1]) for key in repo.blobs.list("chunks/")]


def test_a_chain_at_max_depth_is_followed_by_a_keyframe(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s", max_depth=2)
    states = training_states(6)
    depths = []
    for state in states:
        repo.save(state, "ckpt")
        depths.append(tensor_encodings(repo, "ckpt")["model.0.weight"].get("depth", 0))
    assert depths == [0, 1, 2, 0, 1, 2]
    for back, state in enumerate(reversed(states)):
        assert_bit_exact(repo.load(f"ckpt~{back}"), state)


def test_a_base_that_is_itself_a_delta_decodes_and_is_listed(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s")
    states = training_states(3)
    for state in states:
        repo.save(state, "ckpt")
    first = repo.manifest("ckpt~2").tensors
    second = repo.manifest("ckpt~1")
    third = repo.manifest("ckpt")
    index = next(i for i, t in enumerate(third.tensors) if (t.encoding or {}).get("depth") == 2)
    bases = set(third.tensors[index].base_digests())
    # Both the parent's chunks (a delta) and the grandparent's (the keyframe) are listed.
    assert {c.digest for c in second.tensors[index].chunks} <= bases
    assert {c.digest for c in first[index].chunks} <= bases
    middle = second.tensors[index].chunks[0].digest
    assert repo.objects.chunk_base(middle) is not None
    assert_bit_exact(repo.load("ckpt"), states[-1])


def test_a_corrupted_base_chunk_fails_the_dependent_tensor_with_integrity_error(
    tmp_path: Path,
) -> None:
    repo = delta_repo(tmp_path / "s")
    states = training_states(2)
    repo.save(states[0], "ckpt")
    repo.save(states[1], "ckpt")
    entry = next(t for t in repo.manifest("ckpt").tensors if t.base_digests())
    base = entry.base_digests()[0]
    path = local_root(repo) / chunk_key(base)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(cas.IntegrityError):
        repo.load("ckpt")


def test_gc_from_manifests_alone_keeps_the_bases_of_a_kept_checkpoint(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s")
    states = training_states(3)
    repo.save(states[0], "runs/r1/step1")
    repo.save(states[1], "runs/r1/step2", parent="runs/r1/step1")
    repo.save(states[2], "runs/r1/step3", parent="runs/r1/step2")
    repo.rm("runs/r1/step1")
    repo.rm("runs/r1/step2")
    collect_garbage(repo)
    assert_bit_exact(repo.load("runs/r1/step3"), states[2])


def test_reusing_a_delta_chunk_records_its_bases_so_gc_spares_them(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s")
    states = training_states(2)
    repo.save(states[0], "a")
    repo.save(states[1], "b", parent="a")
    # The same weights saved again with no parent: every chunk is a dedup hit on a delta chunk.
    repo.save(states[1], "gates/best")
    manifest = repo.manifest("gates/best")
    assert any(t.base_digests() for t in manifest.tensors)
    assert repo.last_write.new_chunks == 0
    repo.rm("a")
    repo.rm("b")
    assert collect_garbage(repo) > 0
    assert_bit_exact(repo.load("gates/best"), states[1])


def test_a_raw_store_rewrites_a_reused_delta_chunk_standalone(tmp_path: Path) -> None:
    delta_store = delta_repo(tmp_path / "s")
    states = training_states(2)
    delta_store.save(states[0], "a")
    delta_store.save(states[1], "b", parent="a")
    raw_store = cas.open(tmp_path / "s")
    raw_store.save(states[1], "hot", codec="raw")
    assert not any(t.base_digests() for t in raw_store.manifest("hot").tensors)
    raw_store.rm("a")
    raw_store.rm("b")
    collect_garbage(raw_store)
    assert_bit_exact(raw_store.load("hot", mmap=True), states[1])


def test_a_reused_chunk_whose_base_is_gone_is_rewritten(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s")
    states = training_states(2)
    repo.save(states[0], "a")
    repo.save(states[1], "b", parent="a")
    for digest in repo.manifest("a").chunk_digests() - repo.manifest("b").chunk_digests():
        repo.blobs.delete(chunk_key(digest))
    # "a" is half gone and "b" cannot decode; saving b's state again heals the chunks it needs.
    base_entries = {d for t in repo.manifest("b").tensors for d in t.base_digests()}
    for digest in base_entries:
        repo.blobs.delete(chunk_key(digest))
    repo.save(states[1], "again")
    assert_bit_exact(repo.load("again"), states[1])
    assert_bit_exact(repo.load("b"), states[1])


def _absent_at_first_look(monkeypatch: pytest.MonkeyPatch, keys: set[str]) -> None:
    """Make the first presence check of each key report it absent, as when two writers check a
    new chunk at the same moment: the writer goes on to encode and store it."""
    real = ObjectStore.stored_base
    looked: set[str] = set()
    lock = threading.Lock()

    def stored_base(
        self: ObjectStore, digest: Digest, size: int | None = None
    ) -> tuple[bool, Digest | None]:
        key = chunk_key(digest)
        with lock:
            first = key in keys and key not in looked
            looked.add(key)
        return (False, None) if first else real(self, digest, size)

    monkeypatch.setattr(ObjectStore, "stored_base", stored_base)


def _record_puts(monkeypatch: pytest.MonkeyPatch) -> list[PutResult]:
    """Every ``PutResult`` that ``ObjectStore.put_chunk`` returns from now on."""
    real = ObjectStore.put_chunk
    results: list[PutResult] = []

    def put_chunk(self: ObjectStore, *args: Any, **kwargs: Any) -> PutResult:
        result = real(self, *args, **kwargs)
        results.append(result)
        return result

    monkeypatch.setattr(ObjectStore, "put_chunk", put_chunk)
    return results


@pytest.mark.parametrize("first", ["delta", "standalone"])
def test_a_chunk_stored_first_keeps_its_encoding_and_a_racing_writer_gets_its_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    objects = delta_repo(tmp_path / "s").objects
    base_a, base_b, chunk = (random.Random(seed).randbytes(CHUNK) for seed in range(3))
    a = objects.put_chunk(base_a, codec_by_name("raw")).digest
    b = objects.put_chunk(base_b, codec_by_name("raw")).digest
    xor = codec_by_name("xor-delta")
    if first == "delta":
        stored = objects.put_chunk(chunk, xor, EncodeHints(base=base_a, base_digest=a))
    else:
        stored = objects.put_chunk(chunk, codec_by_name("zstd"))
    stored_base = a if first == "delta" else None
    _absent_at_first_look(monkeypatch, {chunk_key(stored.digest)})
    # The second writer encodes against b, finds the chunk taken when it writes, and is told so.
    lost = objects.put_chunk(chunk, xor, EncodeHints(base=base_b, base_digest=b))
    assert (lost.digest, lost.new, lost.stored_bytes, lost.base) == (
        stored.digest,
        False,
        0,
        stored_base,
    )
    assert objects.chunk_base(stored.digest) == stored_base
    objects.blobs.delete(chunk_key(b))  # only the loser's manifest would have named b
    assert objects.get_chunk(stored.digest) == chunk


def test_a_chunk_whose_stored_header_is_damaged_is_written_again(tmp_path: Path) -> None:
    objects = delta_repo(tmp_path / "s").objects
    chunk = random.Random(5).randbytes(CHUNK)
    digest = objects.put_chunk(chunk, codec_by_name("zstd")).digest
    objects.blobs.put(chunk_key(digest), b"not a cas object")
    result = objects.put_chunk(chunk, codec_by_name("zstd"))
    assert result.new and result.stored_bytes > 0
    assert objects.get_chunk(digest) == chunk


def test_a_damaged_chunk_repaired_by_a_delta_writer_is_stored_standalone(tmp_path: Path) -> None:
    # Repairs overwrite, so several repairing writers race with last-write-wins: each must store
    # an encoding that needs no base, whatever base its own manifest would record.
    objects = delta_repo(tmp_path / "s").objects
    rng = random.Random(6)
    base = rng.randbytes(CHUNK)
    chunk = bytes(b ^ (1 if i % 7 == 0 else 0) for i, b in enumerate(base))
    base_digest = objects.put_chunk(base, codec_by_name("zstd")).digest
    digest = objects.put_chunk(chunk, codec_by_name("zstd")).digest
    objects.blobs.put(chunk_key(digest), b"not a cas object")
    hints = EncodeHints(elem_size=4, level=1, base=base, base_digest=base_digest)
    result = objects.put_chunk(chunk, codec_by_name("sub-delta"), hints)
    assert result.new and result.base is None
    assert objects.chunk_base(digest) is None
    objects.blobs.delete(chunk_key(base_digest))
    assert objects.get_chunk(digest) == chunk


def test_a_save_that_loses_a_chunk_race_records_the_stored_base_so_gc_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = delta_repo(tmp_path / "s", codec="xor-delta")
    torch.manual_seed(0)
    a, b, x = ({"w": torch.randn(64, 256)} for _ in range(3))
    first.save(a, "a")
    first.save(b, "b")
    first.save(x, "x1", parent="a")
    a_chunks = [c.digest for c in first.manifest("a").tensors[0].chunks]
    x_chunks = [c.digest for c in first.manifest("x1").tensors[0].chunks]
    assert len(x_chunks) == 4
    assert [first.objects.chunk_base(d) for d in x_chunks] == a_chunks

    # A second writer checked x's chunks at the same moment (absent) and encodes them against b.
    second = cas.open(tmp_path / "s")
    _absent_at_first_look(monkeypatch, {chunk_key(d) for d in x_chunks})
    results = _record_puts(monkeypatch)
    second.save(x, "x2", parent="b")
    got = {r.digest: r for r in results if r.digest in x_chunks}
    assert {d: (r.new, r.base) for d, r in got.items()} == {
        d: (False, base) for d, base in zip(x_chunks, a_chunks, strict=True)
    }
    assert second.last_write.new_chunks == 0
    assert [second.objects.chunk_base(d) for d in x_chunks] == a_chunks
    assert set(a_chunks) <= set(second.manifest("x2").tensors[0].base_digests())

    # Either checkpoint alone survives a GC from manifests alone (everything else deleted).
    for keep in ("x1", "x2"):
        root = tmp_path / f"gc-{keep}"
        shutil.copytree(tmp_path / "s", root)
        repo = cas.open(root)
        for ref in {"a", "b", "x1", "x2"} - {keep}:
            repo.rm(ref)
        assert collect_garbage(repo) > 0
        assert_bit_exact(repo.load(keep), x)


def test_a_fine_tune_is_a_delta_against_its_named_base_model(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s")
    torch.manual_seed(0)
    base = {"encoder.weight": torch.randn(256, 128), "head.weight": torch.randn(8, 128)}
    tuned = {k: v + 1e-4 * torch.randn_like(v) for k, v in base.items()}
    repo.save(base, "models/base")
    repo.save(tuned, "runs/ft/final", parent="models/base")
    encodings = tensor_encodings(repo, "runs/ft/final")
    assert encodings["encoder.weight"]["codec"] in DELTA_CODECS
    usage = repo.manifest_usage(repo.manifest("runs/ft/final"))
    assert usage.ratio < 0.6 and usage.stored_with_bases > usage.stored_bytes
    assert_bit_exact(repo.load("runs/ft/final"), tuned)


def test_a_frozen_tensor_costs_nothing_and_needs_no_trial(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s")
    torch.manual_seed(0)
    frozen = torch.randn(128, 128)
    repo.save({"frozen": frozen, "head": torch.randn(64, 64)}, "ft")
    repo.save({"frozen": frozen, "head": torch.randn(64, 64)}, "ft")
    stats = repo.last_write
    assert stats.reused_chunks == frozen.numel() * 4 // CHUNK


def test_incompressible_tensors_stay_raw(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s")
    noise = torch.randint(
        0, 256, (100_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    repo.save({"noise": noise, "zeros": torch.zeros(100_000)}, "r")
    encodings = tensor_encodings(repo, "r")
    assert encodings["noise"] == {}
    assert encodings["zeros"]["codec"] in ("shuffle-zstd", "bitshuffle-zstd")
    assert_bit_exact(repo.load("r", mmap=True), {"noise": noise, "zeros": torch.zeros(100_000)})


def test_ingested_safetensors_files_delta_against_the_parent_file(tmp_path: Path) -> None:
    repo = delta_repo(tmp_path / "s")
    states = training_states(2)
    paths = []
    for i, state in enumerate(states):
        path = tmp_path / f"v{i}" / "model.safetensors"
        path.parent.mkdir()
        save_file({k: v.contiguous() for k, v in state["model"].items()}, str(path))
        paths.append(path)
    repo.put_path(paths[0], "files/model")
    repo.put_path(paths[1], "files/model")
    manifest = repo.manifest("files/model")
    assert any((t.encoding or {}).get("codec") in DELTA_CODECS for t in manifest.tensors)
    out = repo.get_path("files/model", tmp_path / "out")
    assert out[0].read_bytes() == paths[1].read_bytes()


def test_the_cli_takes_a_parent_and_shows_stored_bytes(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    runner = CliRunner()
    result = runner.invoke(
        cli, ["--store", store, "init", "--codec", "auto", "--chunk-size", str(CHUNK)]
    )
    assert result.exit_code == 0 and "codec auto" in result.output, result.output
    assert (
        runner.invoke(cli, ["--store", str(tmp_path / "x"), "init", "--codec", "nope"]).exit_code
        == 1
    )
    states = training_states(2)
    for i, state in enumerate(states):
        path = tmp_path / f"v{i}.safetensors"
        save_file({k: v.contiguous() for k, v in state["model"].items()}, str(path))
        ref = "models/v0" if i == 0 else "models/v1"
        args = ["--store", store, "put", str(path), ref, "--codec", "auto"]
        if i:
            args += ["--parent", "models/v0"]
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["--store", store, "show", "models/v1"])
    assert result.exit_code == 0, result.output
    assert "stored" in result.output and "delta bases" in result.output
    assert "-shuffle-zstd" in result.output
    result = runner.invoke(cli, ["--store", store, "show", "models/v1", "--json"])
    assert '"ratio"' in result.output


def test_a_hot_raw_copy_and_a_compressed_archive_share_identities(tmp_path: Path) -> None:
    hot = cas.open(tmp_path / "hot", config=StoreConfig(chunk_size=CHUNK, inline_max=256))
    archive = delta_repo(tmp_path / "archive")
    states = training_states(2)
    hot.save(states[0], "ckpt")
    digest = hot.save(states[1], "ckpt")
    manifest = hot.manifest("ckpt")
    results = list(recode_manifest(hot.objects, archive.objects, manifest, "auto"))
    assert all(r.new for r in results)
    archive.objects.put_manifest(hot.objects.get_manifest(digest), archive.codec("zstd"))
    archive.refs_store.set("ckpt", digest)
    assert_bit_exact(archive.load("ckpt"), states[1])
    assert archive.stored_bytes(manifest.chunk_digests()) < hot.stored_bytes(
        manifest.chunk_digests()
    )
    # Deltas travel as they are ("keep"), their bases first.
    archive.save(states[0], "old")
    archive.save(states[1], "new", parent="old")
    mirror = cas.open(tmp_path / "mirror")
    new_manifest = archive.manifest("new")
    for ref in new_manifest.chunk_refs():
        recode_chunk(archive.objects, mirror.objects, ref.digest, "keep")
    for ref in new_manifest.chunk_refs():
        assert mirror.objects.get_chunk(ref.digest) == archive.objects.get_chunk(ref.digest)
    with pytest.raises(cas.FormatError):
        recode_chunk(
            hot.objects, archive.objects, manifest.tensors[0].chunks[0].digest, "xor-delta"
        )


@pytest.mark.parametrize(
    "section",
    [
        {"max_depth": -1},
        {"max_depth": "8"},
        {"depth": 3},
        {"min_saving": 1.5},
        {"cache_bytes": -1},
        [],
    ],
)
def test_bad_delta_settings_in_the_store_config_are_refused(tmp_path: Path, section: Any) -> None:
    with pytest.raises(cas.FormatError):
        cas.open(tmp_path / "s", config=StoreConfig(extra={"delta": section}))
    assert not (tmp_path / "s" / "config").exists()


@pytest.mark.s3
def test_an_s3_archive_stores_deltas_and_keeps_reused_bases(s3_url: str) -> None:
    extra = {"delta": {"max_depth": 4}}
    repo = cas.open(
        s3_url, config=StoreConfig(chunk_size=CHUNK, inline_max=256, codec="auto", extra=extra)
    )
    states = training_states(2)
    repo.save(states[0], "runs/a")
    repo.save(states[1], "runs/a")
    repo.save(states[1], "gates/best")  # dedup hits on delta chunks, learnt from S3 headers
    assert any(t.base_digests() for t in repo.manifest("gates/best").tensors)
    repo.rm("runs/a")
    collect_garbage(repo)
    assert_bit_exact(repo.load("gates/best"), states[1])


def test_a_push_onto_a_chunk_the_destination_stored_as_a_delta_keeps_it_decodable(
    tmp_path: Path,
) -> None:
    # The destination already holds states[1]'s chunks as deltas against states[0] (refs a, b);
    # the source pushes the same bytes stored standalone, whose manifest records no base. The
    # pushed checkpoint must survive a GC that keeps only it.
    states = training_states(2)
    dst = delta_repo(tmp_path / "dst")
    dst.save(states[0], "a")
    dst.save(states[1], "b", parent="a")
    assert any(t.base_digests() for t in dst.manifest("b").tensors)
    src = delta_repo(tmp_path / "src", codec="raw")
    src.save(states[1], "pushed")
    assert not any(t.base_digests() for t in src.manifest("pushed").tensors)
    assert src.push(dst, ["pushed"]).chunks_rewritten > 0
    assert src.push(dst, ["pushed"]).chunks_rewritten == 0  # now standalone: nothing to fix
    # A delta store pushed onto a copy of itself records the same chains: nothing is rewritten.
    mirror = delta_repo(tmp_path / "mirror")
    assert dst.push(mirror, ["b"]).chunks_moved > 0
    assert dst.push(mirror, ["b"]).chunks_rewritten == 0
    dst.rm("a")
    dst.rm("b")
    assert collect_garbage(dst) > 0
    assert_bit_exact(dst.load("pushed"), states[1])


def _noise(seed: int, n: int = CHUNK // 4) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _nudged(t: torch.Tensor, at: int) -> torch.Tensor:
    out = t.clone()
    out[at] += 1.0
    return out


def test_a_save_after_a_push_records_the_base_any_entry_lists_for_a_chunk(tmp_path: Path) -> None:
    # After the push, chunk X sits in the pushed manifest twice: standalone in t0, and in t1 next
    # to Y, a delta whose chain lists B. The destination stores X against B, which the push
    # accepts because t1 lists B. A save against that manifest must learn X's chain from both
    # entries, or its delta against X records no B and GC sweeps B.
    x, b, other = _noise(1), _noise(2), _noise(3)
    src = delta_repo(tmp_path / "src", codec="xor-delta")
    src.save({"t0": x, "t1": torch.cat([other, b])}, "s1")
    src.save({"t0": x, "t1": torch.cat([x, _nudged(b, 7)])}, "m", parent="s1")
    dst = delta_repo(tmp_path / "dst", codec="xor-delta")
    dst.save({"u": b}, "d1")
    dst.save({"u": x}, "d2", parent="d1")  # X stored at the destination against B
    assert src.push(dst, ["m"]).chunks_rewritten == 0
    later = _nudged(x, 11)
    dst.save({"t0": later}, "d3", parent="m")
    for ref in ("d1", "d2", "m"):
        dst.rm(ref)
    collect_garbage(dst)
    assert torch.equal(dst.load("d3")["t0"], later)


def test_a_skipped_chunk_swept_during_a_push_is_stored_again_before_the_ref_moves(
    tmp_path: Path,
) -> None:
    from cas.digest import digest_of

    first = _noise(4)
    second = _nudged(first, 5)
    third = _nudged(second, 9)
    src = delta_repo(tmp_path / "src", codec="xor-delta")
    src.save({"t": first}, "s1")
    src.save({"t": second}, "s2", parent="s1")
    src.save({"t": third}, "s3", parent="s2")
    dst = delta_repo(tmp_path / "dst", codec="xor-delta")
    dst.save({"u": first}, "old1")
    dst.save({"u": second}, "old2", parent="old1")
    dst.rm("old1")
    dst.rm("old2")  # the destination holds the bases, unreferenced: GC candidates
    base = digest_of(first.numpy().tobytes())

    swept: list[str] = []

    def concurrent_sweep(moved: int, skipped: int) -> None:  # first call: after the lookup
        if not swept:
            swept.append(base)
            dst.blobs.delete(chunk_key(base))

    report = src.push(dst, ["s3"], progress=concurrent_sweep)
    assert report.chunks_rewritten == 1
    assert torch.equal(dst.load("s3")["t"], third)
