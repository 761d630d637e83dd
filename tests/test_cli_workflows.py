"""The CLI as restic, git, dvc and hf users type it: options anywhere, one file out, diff exit
codes, messages and tags, sizes that agree, JSON errors, modes and times restored."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import save_file

import cas
from cas.cli import cli
from cas.cli.app import hoist_global_options
from cas.errors import FormatError
from cas.model.where import MetaCondition


def _run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


def _ok(*args: str) -> Result:
    result = _run(*args)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """An HF-style checkpoint directory: two safetensors shards, a config, an executable."""
    root = tmp_path / "checkpoint-500"
    root.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i in (1, 2):
        save_file(
            {f"layer{i}.weight": torch.randn(256, 64, generator=gen)},
            root / f"model-0000{i}-of-00002.safetensors",
        )
    (root / "config.json").write_text('{"hidden": 64}\n')
    (root / "train.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "train.sh").chmod(0o750)
    os.utime(root / "config.json", ns=(1_600_000_000_000_000_000, 1_600_000_000_123_456_789))
    return root


# 1. Global options anywhere


def test_store_quiet_and_endpoint_work_after_the_command_name(tmp_path: Path) -> None:
    store = tmp_path / "store"
    src = tmp_path / "w.bin"
    src.write_bytes(b"weights" * 100)
    _ok("put", str(src), "runs/r1/ckpt", "-q", "--store", str(store))
    assert _ok("ls", "--store", str(store)).output == "runs/r1/ckpt\n"
    assert _ok(f"--store={store}", "ls").output == "runs/r1/ckpt\n"
    assert _ok("ls", f"--store={store}", "-q").output == "runs/r1/ckpt\n"
    # The README's form: the endpoint after the command, with --to's value in between.
    args = ["push", "runs/r1/**", "--to", "s3://b/p", "--endpoint-url", "http://h:1", "-j", "2"]
    assert hoist_global_options(cli, args) == [
        "--endpoint-url", "http://h:1", "push", "runs/r1/**", "--to", "s3://b/p", "-j", "2"
    ]  # fmt: skip


def test_an_option_value_that_reads_like_a_global_option_stays_the_commands(
    tmp_path: Path,
) -> None:
    # `-m -q` is a message "-q"; a REF after `--` is never an option.
    args = ["put", "x", "r", "-m", "-q", "--store", "s"]
    assert hoist_global_options(cli, args) == ["--store", "s", "put", "x", "r", "-m", "-q"]
    assert hoist_global_options(cli, ["rm", "--", "-q"]) == ["rm", "--", "-q"]
    assert hoist_global_options(cli, ["policy", "set", "-q"]) == ["-q", "policy", "set"]


def test_push_with_the_endpoint_after_the_command_reaches_s3(
    tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # only the option after `push` says where S3 is
    store = tmp_path / "store"
    cas.open(store).save({"w": torch.ones(5000)}, "runs/r1/ckpt_1")
    result = _run(
        "push", "runs/r1/**", "--to", s3_url, "--endpoint-url", endpoint, "--store", str(store)
    )
    assert result.exit_code == 0, result.output
    assert cas.open(s3_url, endpoint_url=endpoint).ref_names() == ["runs/r1/ckpt_1"]


# 3. One file out of a checkpoint


def test_cat_writes_one_file_of_a_checkpoint_byte_identical_to_stdout(
    tmp_path: Path, hf_dir: Path
) -> None:
    store = tmp_path / "store"
    _ok("--store", str(store), "put", str(hf_dir), "runs/r1/checkpoint-500")
    shard = hf_dir / "model-00002-of-00002.safetensors"
    out = tmp_path / "x.safetensors"
    with out.open("wb") as sink:  # a real process, its stdout a file, as `> x` makes it
        done = subprocess.run(
            [sys.executable, "-m", "cas", "cat", "runs/r1/checkpoint-500/" + shard.name],
            stdout=sink,
            stderr=subprocess.PIPE,
            env={**os.environ, "CAS_STORE": str(store)},
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == shard.read_bytes()
    # NAME~N/PATH reads an older version; a single ingested file needs no path.
    assert _ok(
        "--store", str(store), "cat", "runs/r1/checkpoint-500~0/config.json"
    ).stdout_bytes == (b'{"hidden": 64}\n')
    _ok("--store", str(store), "put", str(shard), "shard")
    assert _ok("--store", str(store), "cat", "shard").stdout_bytes == shard.read_bytes()
    missing = _run("--store", str(store), "cat", "runs/r1/checkpoint-500/nope.bin")
    assert missing.exit_code == 1 and "no file 'nope.bin'" in missing.output


def test_get_include_writes_only_the_matching_files(tmp_path: Path, hf_dir: Path) -> None:
    store = tmp_path / "store"
    _ok("--store", str(store), "put", str(hf_dir), "ck")
    out = tmp_path / "out"
    _ok("--store", str(store), "get", "ck", "--include", "model*.safetensors", f"{out}/")
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    for path in out.iterdir():
        assert path.read_bytes() == (hf_dir / path.name).read_bytes()
    none = _run("--store", str(store), "get", "ck", "--include", "*.bin", str(tmp_path / "o2"))
    assert none.exit_code == 1 and "matches no file" in none.output


# 4. diff


def test_diff_exit_code_is_one_when_different_and_zero_when_same(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = cas.open(store)
    repo.save({"w": torch.zeros(3000)}, "a")
    repo.save({"w": torch.zeros(3000)}, "same")
    repo.save({"w": torch.ones(3000)}, "b")
    assert _run("--store", str(store), "diff", "a", "same", "--exit-code").exit_code == 0
    assert _run("--store", str(store), "diff", "a", "b", "--exit-code").exit_code == 1
    assert _run("--store", str(store), "diff", "a", "b").exit_code == 0  # without it, as git


def test_diff_pairs_tensors_saved_under_a_model_prefix_with_unprefixed_ones(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    repo = cas.open(store)
    w, b = torch.arange(3000.0), torch.zeros(3000)
    repo.save({"model": {"w": w, "b": b}}, "wrapped")
    repo.save({"w": w, "b": b + 1}, "bare")
    out = _ok("--store", str(store), "diff", "wrapped", "bare").output
    assert "without the prefix 'model.'" in out
    assert out.splitlines()[1:] == ["M model.b -> b"]  # w is the same under both names
    rows = json.loads(_ok("--store", str(store), "diff", "wrapped", "bare", "--json").output)
    assert rows == [
        {
            "path": "b",
            "change": "changed",
            "nbytes": 12000,
            "kind": "tensor",
            "left_path": "model.b",
        }
    ]
    # An ingested safetensors file of the bare state dict pairs with the wrapped state.
    save_file({"w": w, "b": b}, tmp_path / "model.safetensors")
    repo.put_path(tmp_path / "model.safetensors", "hf")
    rows = json.loads(_ok("--store", str(store), "diff", "wrapped", "hf", "--all", "--json").output)
    paired = {r["path"]: (r["change"], r["left_path"]) for r in rows if r["kind"] == "tensor"}
    assert paired == {
        "model.safetensors:b": ("same", "model.b"),
        "model.safetensors:w": ("same", "model.w"),
    }
    # Names that already match are compared as they are.
    repo.save({"model": {"w": w}, "w": w}, "both")
    assert "prefix" not in _ok("--store", str(store), "diff", "both", "bare").output


# 5. Messages, tags and filters


def test_put_with_a_message_and_tag_shows_in_ls_and_log_and_filters(tmp_path: Path) -> None:
    store = tmp_path / "store"
    src = tmp_path / "w.bin"
    src.write_bytes(b"x" * 1000)
    for step, extra in ((500, []), (1500, ["--tag", "eval"]), (2000, [])):
        _ok(
            "--store", str(store), "put", str(src), f"runs/s{step}",
            "-m", f"fine-tune v{step}", "--meta", f"step={step}", *extra,
        )  # fmt: skip
    long = _ok("--store", str(store), "ls", "-l", "runs/").output
    assert "runs/s1500 [eval]  fine-tune v1500" in long
    log = _ok("--store", str(store), "log", "runs/s1500").output
    assert "fine-tune v1500 [eval]" in log
    picked = _ok("--store", str(store), "ls", "runs/", "--where", "step>=1000", "--tag", "eval")
    assert picked.output == "runs/s1500\n"
    assert _ok("--store", str(store), "ls", "runs/", "--where", "step>=1000").output == (
        "runs/s1500\nruns/s2000\n"
    )
    bad = _run("--store", str(store), "ls", "--where", "step>>1")
    assert bad.exit_code == 2 and "KEY OP VALUE" in bad.output


def test_save_keeps_message_and_tags_in_python(tmp_path: Path) -> None:
    repo = cas.open(tmp_path / "store")
    repo.save({"w": torch.ones(3)}, "r", {"step": 7}, message="fine-tune v2", tags=["eval", "best"])
    manifest = repo.manifest("r")
    assert (manifest.message, manifest.tags) == ("fine-tune v2", ("eval", "best"))
    rows = json.loads(_ok("--store", str(tmp_path / "store"), "ls", "--json").output)
    assert rows[0]["message"] == "fine-tune v2" and rows[0]["tags"] == ["eval", "best"]
    repo.cp("r", "weights", only="w")  # a subset copy keeps what the checkpoint is
    assert repo.manifest("weights").tags == ("eval", "best")
    with pytest.raises(FormatError, match="bad tag"):
        repo.save({"w": torch.ones(3)}, "r2", tags=["two words"])


@pytest.mark.parametrize(
    ("condition", "meta", "expected"),
    [
        ("step>=1000", {"step": 1000}, True),
        ("step>=1000", {"step": 999}, False),
        ("step > 1e3", {"step": 1001}, True),
        ("loss<0.5", {"loss": 0.4}, True),
        ("phase==warmup", {"phase": "warmup"}, True),
        ("phase!=warmup", {"phase": "warmup"}, False),
        ("phase!=warmup", {}, True),
        ("step>=1000", {}, False),
        ("step>=1000", {"step": "many"}, False),
        ("eval.loss<2", {"eval": {"loss": 1.5}}, True),
        ("name=3", {"name": "3"}, True),
        ("__import__('os')>=1", {}, False),
    ],
)
def test_where_conditions_compare_metadata_without_evaluating_code(
    condition: str, meta: dict[str, object], expected: bool
) -> None:
    if "(" in condition:
        with pytest.raises(ValueError, match="KEY OP VALUE"):
            MetaCondition.parse(condition)
        return
    assert MetaCondition.parse(condition).matches(meta) is expected


# 6. Sizes that agree


def test_stats_du_and_show_count_the_same_stored_bytes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = cas.open(store)
    # Small tensors live inlined in the manifest; the big one in chunks.
    state = {f"bias{i}": torch.full((16,), float(i)) for i in range(50)}
    repo.save({**state, "w": torch.ones(100_000)}, "only")
    show = json.loads(_ok("--store", str(store), "show", "only", "--json").output)
    du = json.loads(_ok("--store", str(store), "du", "--json").output)
    stats = json.loads(_ok("--store", str(store), "stats", "--json").output)
    assert show["manifest_bytes"] > 0 and show["stored_bytes"] > show["manifest_bytes"]
    assert show["stored_with_bases"] == du["stored_bytes"] == stats["stored_bytes"]
    assert stats["dedup_ratio"] == round(stats["logical_bytes"] / stats["stored_bytes"], 4)
    repo.cp("only", "copy")  # a copy is free: logical doubles, stored does not
    again = json.loads(_ok("--store", str(store), "stats", "--json").output)
    assert again["stored_bytes"] == stats["stored_bytes"]
    assert again["dedup_ratio"] == pytest.approx(2 * stats["dedup_ratio"], rel=1e-3)


# 7. JSON errors


def test_with_json_an_error_is_one_json_object_on_stderr_and_the_exit_code_stays(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    cas.open(store).save({"w": torch.ones(3)}, "r")
    missing = _run("--store", str(store), "show", "nope", "--json")
    assert missing.exit_code == 1 and missing.stdout == ""
    assert json.loads(missing.stderr) == {
        "error": "no ref named 'nope'",
        "type": "NotFound",
        "exit_code": 1,
    }
    usage = _run("--store", str(store), "ls", "--bogus", "--json")
    assert usage.exit_code == 2 and json.loads(usage.stderr)["type"] == "NoSuchOption"
    plain = _run("--store", str(store), "show", "nope")
    assert plain.exit_code == 1 and plain.stderr.startswith("cas: error: NotFound")


# 8. Modes and times


def test_get_restores_file_modes_and_modification_times(tmp_path: Path, hf_dir: Path) -> None:
    store = tmp_path / "store"
    _ok("--store", str(store), "put", str(hf_dir), "ck")
    out = tmp_path / "out"
    _ok("--store", str(store), "get", "ck", str(out))
    for name in ("train.sh", "config.json", "model-00001-of-00002.safetensors"):
        before, after = (hf_dir / name).stat(), (out / name).stat()
        assert stat.S_IMODE(after.st_mode) == stat.S_IMODE(before.st_mode), name
        assert after.st_mtime_ns == before.st_mtime_ns, name
    assert stat.S_IMODE((out / "train.sh").stat().st_mode) == 0o750
    digest = hashlib.sha256((out / "config.json").read_bytes()).hexdigest()
    assert digest == hashlib.sha256((hf_dir / "config.json").read_bytes()).hexdigest()


def test_a_manifest_without_times_still_gets_its_files_back(tmp_path: Path) -> None:
    from dataclasses import replace

    from cas.model.manifest import decode_manifest, encode_manifest

    repo = cas.open(tmp_path / "store")
    src = tmp_path / "f.bin"
    src.write_bytes(b"old" * 100)
    repo.put_path(src, "new")
    manifest = repo.manifest("new")
    old = replace(manifest, files={p: replace(e, mtime_ns=None) for p, e in manifest.files.items()})
    assert b"mtime_ns" not in encode_manifest(old)  # as an older cas wrote it
    assert decode_manifest(encode_manifest(old)).files["f.bin"].mtime_ns is None
    repo.commit(old, "old")
    (written,) = repo.get_path("old", tmp_path / "back.bin")
    assert written.read_bytes() == b"old" * 100
