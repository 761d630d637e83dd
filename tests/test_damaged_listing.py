"""One damaged object never hides the rest: `ls`, `du`, `stats`, `log` and `verify` name a damaged
ref or manifest and still show everything else; only `verify` (and a `log` cut short) fail."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import cas
import cas.refs.store as refs_mod
from cas.cli import cli
from cas.objects.store import manifest_key


@dataclass
class Store:
    """A store with refs runs/a, runs/b and runs/c, each a different small file."""

    path: Path

    def cas(self, *args: str) -> Result:
        return CliRunner().invoke(cli, ["--store", str(self.path), *args], catch_exceptions=False)

    def damage_ref(self, name: str) -> None:
        (self.path / "refs" / name.replace("/", "%2F")).write_bytes(b"not a ref record")

    def damage_manifest_of(self, name: str) -> None:
        target = cas.open(self.path).resolve(name)
        (self.path / manifest_key(target)).write_bytes(b"CASo garbage")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    repo = cas.open(tmp_path / "store")
    for i, name in enumerate(["runs/a", "runs/b", "runs/c"]):
        source = tmp_path / f"{name[-1]}.bin"
        source.write_bytes(os.urandom(20_000 + i * 1000))
        repo.put_path(source, name)
    return Store(tmp_path / "store")


def _warnings(result: Result) -> list[str]:
    lines = result.stderr.splitlines()
    assert all(line.startswith("cas: warning: cannot read ") for line in lines), lines
    return lines


def test_one_damaged_ref_file_is_named_and_every_other_ref_is_listed(store: Store) -> None:
    store.damage_ref("runs/b")
    plain = store.cas("ls")
    assert plain.exit_code == 0 and plain.stdout.split() == ["runs/a", "runs/c"]
    (warning,) = _warnings(plain)
    assert "runs/b" in warning
    long_ = store.cas("ls", "-l")
    assert long_.exit_code == 0 and [line.split()[-1] for line in long_.stdout.splitlines()] == [
        "runs/a",
        "runs/c",
    ]
    as_json = store.cas("ls", "--json")
    assert as_json.exit_code == 0
    assert [row["ref"] for row in json.loads(as_json.stdout)] == ["runs/a", "runs/c"]
    assert len(_warnings(as_json)) == 1


def test_du_and_stats_count_every_readable_ref_and_name_the_damaged_one(store: Store) -> None:
    store.damage_ref("runs/b")
    du = store.cas("du", "--json")
    assert du.exit_code == 0
    report = json.loads(du.stdout)
    assert [row["ref"] for row in report["refs"]] == ["runs/a", "runs/c"]
    assert [d["ref"] for d in report["damaged"]] == ["runs/b"]
    assert report["logical_bytes"] == 20_000 + 22_000
    assert len(_warnings(du)) == 1
    stats = store.cas("stats", "--json")
    assert stats.exit_code == 0
    assert json.loads(stats.stdout)["refs"] == 2
    assert [d["ref"] for d in json.loads(stats.stdout)["damaged"]] == ["runs/b"]
    text = store.cas("du", "-r")
    assert text.exit_code == 0 and "runs/a" in text.stdout and "runs/c" in text.stdout


def test_a_damaged_manifest_hides_no_other_ref_in_ls_du_or_stats(store: Store) -> None:
    store.damage_manifest_of("runs/c")
    long_ = store.cas("ls", "-l")
    assert long_.exit_code == 0
    assert [line.split()[-1] for line in long_.stdout.splitlines()] == [
        "runs/a",
        "runs/b",
        "runs/c",
    ]
    assert "runs/c" in _warnings(long_)[0]
    rows = json.loads(store.cas("ls", "--json").stdout)
    assert [r["ref"] for r in rows if "error" not in r] == ["runs/a", "runs/b"]
    assert [r["ref"] for r in rows if "error" in r] == ["runs/c"]
    du = store.cas("du", "-r")
    assert du.exit_code == 0 and "runs/a" in du.stdout and "runs/b" in du.stdout
    assert "runs/c" in _warnings(du)[0]
    stats = json.loads(store.cas("stats", "--json").stdout)
    assert stats["refs"] == 2 and [d["ref"] for d in stats["damaged"]] == ["runs/c"]


def test_verify_fails_on_a_damaged_ref_and_still_checks_the_rest(store: Store) -> None:
    store.damage_ref("runs/b")
    (store.path / "refs" / "name with spaces").write_bytes(b"x")  # a key that names no ref
    result = store.cas("verify", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["refs"] == 4 and report["manifests"] == 2
    assert sorted(p["ref"] for p in report["problems"]) == ["refs/name with spaces", "runs/b"]


def test_log_shows_the_history_it_can_read_before_a_damaged_segment(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(refs_mod, "INLINE_HISTORY", 8)
    monkeypatch.setattr(refs_mod, "SEAL_EVENTS", 4)
    repo = cas.open(store.path)
    targets = [repo.resolve(n) for n in ("runs/a", "runs/b")]
    for i in range(12):
        repo.set_ref("runs/moving", targets[i % 2], message=f"move {i}")
    record = repo.find_ref("runs/moving")
    assert record is not None and record.sealed
    (store.path / manifest_key(record.sealed[0].digest)).write_bytes(b"CASo garbage")
    result = store.cas("log", "runs/moving")
    assert result.exit_code == 1
    shown = result.stdout.splitlines()
    assert len(shown) == len(record.history) and shown[0].endswith("move 11")
    assert "runs/moving" in _warnings(result)[0]
    assert store.cas("ls").stdout.split() == ["runs/a", "runs/b", "runs/c", "runs/moving"]
