"""The SeaweedFS fixture: a port taken between being picked and being bound is picked again."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cas.testing.seaweed import SeaweedPorts, SeaweedServer
from tests.prerequisites import require_weed


def test_a_first_start_whose_port_was_taken_meanwhile_picks_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_weed()
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real = SeaweedPorts.pick_free.__func__  # type: ignore[attr-defined]
    picks: list[SeaweedPorts] = []

    def pick(cls: type[SeaweedPorts]) -> SeaweedPorts:
        ports: SeaweedPorts = real(cls)
        if not picks:  # the first pick's S3 port is one another process holds
            ports = SeaweedPorts(*[taken if n == ports.s3 else n for n in vars(ports).values()])
        picks.append(ports)
        return ports

    monkeypatch.setattr(SeaweedPorts, "pick_free", classmethod(pick))
    try:
        with SeaweedServer(tmp_path / "weed") as server:
            assert len(picks) == 2 and server.ports.s3 != taken
            assert server.client().list_buckets()["Buckets"] == []
    finally:
        squatter.close()
