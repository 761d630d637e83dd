"""Everyday CLI habits: -V, shell completion with ref names, CAS_PROGRESS, --json everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

import cas
from cas.cli import cli
from cas.cli.app import progress_hidden

NO_JSON = {
    "cat": "writes the bytes of a stored file to stdout",
    "completion": "prints a shell script",
    "mount": "serves a file system in the foreground; prints nothing",
}
"""Commands that print no report, so a --json has nothing to say."""


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    repo = cas.open(root)
    repo.save({"w": torch.zeros(3)}, "runs/r1/ckpt_1")
    repo.save({"w": torch.ones(3)}, "runs/r2/ckpt_1")
    repo.save({"w": torch.ones(3)}, "models/base")
    return root


def _cas(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cas", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_dash_capital_v_prints_the_version_like_dash_dash_version() -> None:
    runner = CliRunner()
    short, long = runner.invoke(cli, ["-V"]), runner.invoke(cli, ["--version"])
    assert short.exit_code == long.exit_code == 0
    assert short.output == long.output and "version" in short.output


@pytest.mark.parametrize(
    ("shell", "marker"),
    [
        ("bash", "complete -o nosort -F _cas_completion cas"),
        ("zsh", "#compdef cas"),
        ("fish", "complete --no-files --command cas"),
    ],
)
def test_cas_completion_prints_the_shells_script(shell: str, marker: str) -> None:
    result = CliRunner().invoke(cli, ["completion", shell])
    assert result.exit_code == 0, result.output
    assert marker in result.output and "_CAS_COMPLETE" in result.output


def test_tab_after_a_ref_argument_offers_the_stores_ref_names(store: Path) -> None:
    def complete(words: str, env: dict[str, str]) -> list[str]:
        result = _cas(
            env={
                "COMP_WORDS": words,
                "COMP_CWORD": str(len(words.split()) - 1),
                "_CAS_COMPLETE": "bash_complete",
                **env,
            }
        )
        assert result.returncode == 0, result.stderr
        return [line for line in result.stdout.splitlines() if line]

    from_env = complete("cas show runs/", {"CAS_STORE": str(store)})
    assert from_env == ["plain,runs/r1/ckpt_1", "plain,runs/r2/ckpt_1"]
    from_option = complete(f"cas --store {store} cp models/", {"CAS_STORE": ""})
    assert from_option == ["plain,models/base"]
    after = complete(f"cas cp --store {store} models/", {"CAS_STORE": ""})
    assert after == ["plain,models/base"]  # the store option after the command counts too
    # A store that cannot be opened completes nothing, quietly.
    assert complete("cas get r", {"CAS_STORE": str(store / "missing")}) == []


def test_cas_progress_decides_whether_bars_show() -> None:
    assert progress_hidden(stderr_is_terminal=False, setting=None)
    assert not progress_hidden(stderr_is_terminal=True, setting=None)
    assert not progress_hidden(stderr_is_terminal=False, setting="1")  # a CI log wants bars
    assert progress_hidden(stderr_is_terminal=True, setting="0")
    assert "CAS_PROGRESS" in CliRunner().invoke(cli, ["--help"]).output


def _commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            out.extend(_commands(command, f"{prefix}{name} "))
        else:
            out.append((f"{prefix}{name}", command))
    return out


def test_every_command_that_prints_a_report_takes_json() -> None:
    missing = [
        name
        for name, command in _commands(cli)
        if name not in NO_JSON and not any("--json" in p.opts for p in command.params)
    ]
    assert missing == []


def test_policy_set_add_clear_and_unlock_print_json(store: Path) -> None:
    def run(*args: str) -> object:
        result = CliRunner().invoke(cli, ["--store", str(store), *args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    doc = run("policy", "set", "--select", "runs/**", "--keep-last", "2")
    assert isinstance(doc, dict) and doc["retention"]["rules"] == [
        {"select": "runs/**", "keep_last": 2}
    ]
    doc = run("policy", "add", "--daily-snapshot", "runs/*/ckpt_*")
    assert isinstance(doc, dict) and doc["retention"]["snapshots"][0]["source"] == "runs/*/ckpt_*"
    assert run("policy", "clear") == {"removed": True}
    assert run("policy", "clear") == {"removed": False}
    assert run("unlock", "--yes") == {"removed": False}


def test_get_into_a_directory_that_does_not_exist_names_the_file_asked_for(
    store: Path, tmp_path: Path
) -> None:
    """The error named the hidden temp file beside the destination, not the destination."""
    missing = tmp_path / "no-such-dir" / "w.safetensors"
    result = _cas("--store", str(store), "get", "runs/r1/ckpt_1", str(missing))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"cas: error: FileNotFoundError: no such directory to write into: {missing}"
    )
    assert not missing.parent.exists()
