"""Named remotes and the config file: `cas remote add archive s3://... --endpoint-url URL`, then
`cas push REF --to archive`, as with git remotes and dvc's config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import cas
from cas.cli import cli
from cas.cli.settings import load_user_config, user_config_path
from cas.errors import FormatError


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A config home of the test's own: nothing of the real user's is read or written."""
    monkeypatch.delenv("CAS_CONFIG", raising=False)
    monkeypatch.delenv("CAS_STORE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    repo = cas.open(root)
    repo.save({"w": torch.arange(5000.0)}, "runs/r1/ckpt_1")
    repo.save({"w": torch.arange(5000.0) + 1}, "runs/r1/ckpt_2")
    return root


def _ok(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result


def test_remote_added_once_is_the_target_of_push_pull_and_archive(
    home: Path, store: Path, tmp_path: Path
) -> None:
    archive = tmp_path / "archive"
    _ok("--store", str(store), "remote", "add", "archive", str(archive))
    _ok("--store", str(store), "push", "runs/r1/ckpt_1", "--to", "archive")
    assert cas.open(archive).ref_names() == ["runs/r1/ckpt_1"]
    _ok("--store", str(store), "archive", "runs/r1/ckpt_2", "--to", "archive")
    assert cas.open(store).ref_names() == ["runs/r1/ckpt_1"]
    _ok("--store", str(store), "pull", "runs/r1/ckpt_2", "--from", "archive")
    assert cas.open(store).ref_names() == ["runs/r1/ckpt_1", "runs/r1/ckpt_2"]
    # The remote is the store's own: another user of the store sees it, the user file is untouched.
    rows = json.loads(_ok("--store", str(store), "remote", "list", "--json").output)
    assert rows == [
        {"name": "archive", "url": str(archive), "endpoint_url": None, "scope": "store"}
    ]
    assert not user_config_path().exists()
    _ok("--store", str(store), "remote", "remove", "archive")
    assert json.loads(_ok("--store", str(store), "remote", "list", "--json").output) == []


def test_a_global_remote_lives_in_the_users_toml_with_its_endpoint_and_no_credentials(
    home: Path, store: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # only the remote knows the endpoint
    _ok("remote", "add", "archive", s3_url, "--endpoint-url", endpoint, "--global")
    text = (home / "cas" / "config.toml").read_text()
    assert f'url = "{s3_url}"' in text and f'endpoint_url = "{endpoint}"' in text
    assert "secret" not in text.lower() and "access_key" not in text.lower()
    assert (home / "cas" / "config.toml").stat().st_mode & 0o077 == 0
    _ok("--store", str(store), "push", "runs/r1/**", "--to", "archive")
    assert cas.open(s3_url, endpoint_url=endpoint).ref_names() == [
        "runs/r1/ckpt_1",
        "runs/r1/ckpt_2",
    ]
    listed = _ok("--store", str(store), "remote", "list").output
    assert "archive" in listed and "[user]" in listed


def test_the_s3_only_endpoint_variable_wins_over_the_global_one_as_in_aws_tools(
    home: Path, store: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    _ok("--store", str(store), "push", "runs/r1/ckpt_1", "--to", s3_url)
    assert cas.open(s3_url).ref_names() == ["runs/r1/ckpt_1"]


def test_the_stores_remote_wins_over_the_users_of_the_same_name(
    home: Path, store: Path, tmp_path: Path
) -> None:
    mine, shared = tmp_path / "mine", tmp_path / "shared"
    _ok("remote", "add", "backup", str(mine), "--global")
    _ok("--store", str(store), "remote", "add", "backup", str(shared))
    _ok("--store", str(store), "push", "runs/r1/ckpt_1", "--to", "backup")
    assert cas.open(shared).ref_names() == ["runs/r1/ckpt_1"] and not mine.exists()
    again = CliRunner().invoke(cli, ["--store", str(store), "remote", "add", "backup", "x/"])
    assert again.exit_code == 1 and "--force" in again.output


def test_the_user_config_names_the_default_store(home: Path, store: Path) -> None:
    path = home / "cas" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text(f'[core]\nstore = "{store}"\n')
    assert _ok("ls").output == "runs/r1/ckpt_1\nruns/r1/ckpt_2\n"


def test_a_config_that_holds_credentials_or_unknown_keys_is_refused_naming_the_file(
    home: Path,
) -> None:
    path = home / "cas" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text('[remote.a]\nurl = "s3://b/p"\naws_secret_access_key = "x"\n')
    with pytest.raises(FormatError, match="never reads credentials"):
        load_user_config()
    path.write_text('[core]\nstor = "/x"\n')
    result = CliRunner().invoke(cli, ["ls"])
    assert result.exit_code == 1 and str(path) in result.output and "stor" in result.output
    path.write_text("[core\n")
    with pytest.raises(FormatError, match="not valid TOML"):
        load_user_config()


def test_a_remote_name_with_a_slash_or_space_is_refused(home: Path, store: Path) -> None:
    for name in ("a/b", "two words", "-x"):
        result = CliRunner().invoke(cli, ["remote", "add", "--global", "--", name, "s3://b/p"])
        assert result.exit_code != 0, name
