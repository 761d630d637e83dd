"""Deltas against the last keyframe: the newest checkpoint of a run decodes at most one delta."""

from __future__ import annotations

from pathlib import Path

import cas
from cas.digest import Digest
from cas.objects.encoding import DeltaSettings
from tests.helpers import assert_bit_exact
from tests.test_delta import (
    DELTA_CODECS,
    collect_garbage,
    delta_repo,
    tensor_encodings,
    training_states,
)


def _keyframe_repo(root: Path, **delta: object) -> cas.Repository:
    from cas.repo.config import StoreConfig

    config = StoreConfig(chunk_size=16 << 10, inline_max=256, codec="auto", extra={"delta": delta})
    return cas.open(root, config=config)


def test_deltas_are_taken_against_the_last_keyframe_by_default() -> None:
    assert DeltaSettings().anchor == "keyframe"


def test_every_checkpoint_of_a_run_is_a_keyframe_or_one_delta_from_one(tmp_path: Path) -> None:
    repo = _keyframe_repo(tmp_path / "s")
    states = training_states(6)
    codecs = set()
    for state in states:
        repo.save(state, "runs/r1/latest")
        for path, encoding in tensor_encodings(repo, "runs/r1/latest").items():
            assert encoding.get("depth", 0) <= 1, path
            codecs.add(encoding.get("codec"))
        # Read from the stored headers, not the manifest: each delta's base is standalone.
        for tensor in repo.manifest("runs/r1/latest").tensors:
            for ref in tensor.chunks:
                base = repo.objects.chunk_base(ref.digest)
                assert base is None or repo.objects.chunk_base(base) is None
    assert codecs & set(DELTA_CODECS), codecs
    for back, state in enumerate(reversed(states)):
        assert_bit_exact(repo.load(f"runs/r1/latest~{back}"), state)


def test_keyframe_deltas_store_less_than_keyframes_alone(tmp_path: Path) -> None:
    states = training_states(5)
    with_deltas = _keyframe_repo(tmp_path / "deltas")
    keyframes_only = _keyframe_repo(tmp_path / "keyframes", max_depth=0)
    for state in states:
        with_deltas.save(state, "ckpt")
        keyframes_only.save(state, "ckpt")

    def stored(repo: cas.Repository) -> int:
        return repo.stored_bytes([Digest(k.rsplit("/", 1)[-1]) for k in repo.blobs.list("chunks/")])

    assert stored(with_deltas) < 0.95 * stored(keyframes_only)


def test_a_delta_that_saves_too_little_against_its_keyframe_starts_a_new_one(
    tmp_path: Path,
) -> None:
    # rekey 0.3: a delta must store under 30% of a fresh keyframe, which AdamW state never does.
    repo = _keyframe_repo(tmp_path / "s", rekey=0.3)
    for state in training_states(3):
        repo.save(state, "ckpt")
        assert all("base" not in e for e in tensor_encodings(repo, "ckpt").values())


def test_gc_keeping_only_the_newest_keeps_its_keyframes(tmp_path: Path) -> None:
    repo = _keyframe_repo(tmp_path / "s")
    states = training_states(4)
    for state in states:
        repo.save(state, "ckpt")
    assert collect_garbage(repo) > 0  # the checkpoints in between go, their keyframes stay
    assert_bit_exact(repo.load("ckpt"), states[-1])


def test_a_store_chained_against_parents_switches_to_keyframes_without_deep_chains(
    tmp_path: Path,
) -> None:
    states = training_states(6)
    chained = delta_repo(tmp_path / "s", max_depth=8)
    for state in states[:4]:
        chained.save(state, "ckpt")
    assert max(e.get("depth", 0) for e in tensor_encodings(chained, "ckpt").values()) == 3
    chained.update_config("delta", {"max_depth": 8, "anchor": "keyframe"})
    chained.close()
    reopened = cas.open(tmp_path / "s")
    for state in states[4:]:
        reopened.save(state, "ckpt")
        assert max(e.get("depth", 0) for e in tensor_encodings(reopened, "ckpt").values()) <= 1
    for back, state in enumerate(reversed(states)):
        assert_bit_exact(reopened.load(f"ckpt~{back}"), state)


def test_a_store_of_the_numpy_codecs_moves_to_the_shuffle_codecs_by_a_push(
    tmp_path: Path,
) -> None:
    old = delta_repo(tmp_path / "old", codec="sub-delta")
    states = training_states(3)
    for state in states:
        old.save(state, "ckpt")
    old_ids = {_codec_id(old, d) for d in _all_chunks(old)}
    assert old_ids <= {2, 4} and 4 in old_ids  # bytegroup-zstd and sub-delta, as written before

    new = cas.open(tmp_path / "new", config=old.config)
    old.push(new, ["ckpt"], codec="auto")
    new_ids = {_codec_id(new, d) for d in _all_chunks(new)}
    assert new_ids and new_ids <= {0, 5, 6, 7}, new_ids  # raw or a shuffle codec, standalone
    assert_bit_exact(new.load("ckpt"), states[-1])
    # The old store still loads every version it holds.
    for back, state in enumerate(reversed(states)):
        assert_bit_exact(old.load(f"ckpt~{back}"), state)


def _all_chunks(repo: cas.Repository) -> list[Digest]:
    return [Digest(k.rsplit("/", 1)[-1]) for k in repo.blobs.list("chunks/")]


def _codec_id(repo: cas.Repository, digest: Digest) -> int:
    from cas.objects.store import chunk_key

    return repo.blobs.get_range(chunk_key(digest), 0, 16)[5]


def test_a_named_delta_codec_also_starts_a_new_keyframe_when_deltas_save_too_little(
    tmp_path: Path,
) -> None:
    states = training_states(3)
    for rekey, expect_deltas in ((0.3, False), (1.0, True)):
        repo = _keyframe_repo(tmp_path / str(rekey), rekey=rekey)
        for state in states:
            repo.save(state, "ckpt", codec="sub-shuffle-zstd")
        encodings = tensor_encodings(repo, "ckpt").values()
        assert any("base" in e for e in encodings) == expect_deltas
        assert_bit_exact(repo.load("ckpt"), states[-1])
