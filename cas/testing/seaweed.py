"""SeaweedServer: a throwaway one-process SeaweedFS with an S3 endpoint, for tests and benchmarks.

``weed server`` runs master, volume, filer and S3 gateway in one process. Every listening port
(HTTP and gRPC) is chosen free up front and kept across ``restart()``, so a test can kill the
server mid-operation and bring the same store back. Without an S3 identity config SeaweedFS
accepts any credentials, so clients may use dummy keys.

Measured on a shared 2-core box: a cold start answers S3 in ~3.3 s (up to ~7 s under load);
a restart on the same data dir also ~3.3 s, because ``-master.electionTimeout=1s`` (the default
10 s left the restarted master leaderless for ~18 s). A graceful SIGTERM takes ~16 s (the filer's
gRPC graceful stop waits 15 s for the embedded S3 gateway), so ``stop()`` sends SIGTERM, waits
``grace`` (1 s) and SIGKILLs; acknowledged writes survive that, being in the page cache already.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
from botocore.config import Config

DUMMY_ACCESS_KEY = "cas-test"
DUMMY_SECRET_KEY = "cas-test-secret"
REGION = "us-east-1"
LOG_NAME = "weed.log"
_PR_SET_PDEATHSIG = 1


class SeaweedStartupError(RuntimeError):
    """``weed server`` exited or did not answer S3 requests in time."""


def find_weed() -> str | None:
    """Path of the ``weed`` binary: next to the running Python (a venv), else on PATH."""
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    # Hold every socket open until all are chosen so the kernel cannot hand out one port twice.
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _die_with_parent() -> None:
    # A killed test run must not leave a server behind on a shared machine. Linux delivers the
    # signal when the *thread* that started the server exits, so start it from a long-lived one.
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True)
class SeaweedPorts:
    """The eight ports one ``weed server`` listens on."""

    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3: int
    s3_grpc: int

    @classmethod
    def pick_free(cls) -> SeaweedPorts:
        """Eight currently free ports on 127.0.0.1."""
        return cls(*_free_ports(8))


class SeaweedServer:
    """A ``weed server -s3`` on 127.0.0.1 whose data lives in ``data_dir``.

    Use as a context manager or call ``start()``/``stop()``. ``endpoint_url`` is the S3 endpoint;
    ``client()`` returns a boto3 client with the dummy credentials the server accepts.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        weed: str | None = None,
        startup_timeout: float = 60.0,
        grace: float = 1.0,
        s3_config: str | os.PathLike[str] | None = None,
    ) -> None:
        found = weed or find_weed()
        if found is None:
            raise FileNotFoundError("no `weed` binary next to the Python interpreter or on PATH")
        self.weed = found
        self.data_dir = Path(data_dir).absolute()
        self.startup_timeout = startup_timeout
        self.grace = grace
        self.s3_config = s3_config
        """An identities file (``weed s3 -config``): then only its credentials are accepted, and
        ``client()``'s dummy ones must be among them (with ``Admin``) for the server to start."""
        self.ports = SeaweedPorts.pick_free()
        self.start_seconds: list[float] = []
        self.stop_seconds: list[float] = []
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint, e.g. ``http://127.0.0.1:40123``."""
        return f"http://127.0.0.1:{self.ports.s3}"

    @property
    def log_path(self) -> Path:
        """Where the server's stdout and stderr go (appended across restarts)."""
        return self.data_dir / LOG_NAME

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs (benchmarks read its CPU time)."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        """The ``weed server`` command line."""
        p = self.ports
        return [
            self.weed,
            "server",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            f"-master.port={p.master}",
            f"-master.port.grpc={p.master_grpc}",
            "-master.telemetry=false",
            # Small volumes: each bucket preallocates a handful, and tests make few bytes.
            "-master.volumeSizeLimitMB=256",
            "-master.electionTimeout=1s",
            # A fixed volume count, not 0 ("free disk / volume size"): on a disk with 1.5 GB free
            # that allowed 5 volumes, one per bucket, and the sixth bucket's writes failed with
            # 500 InternalError. Volumes are not preallocated, so 1000 costs no disk.
            "-volume.max=1000",
            # Read-only below 4 MiB free, not below 1% of the disk (the default): a throwaway
            # server on a big disk that is 99% full stopped answering writes at all.
            "-volume.minFreeSpace=4MiB",
            f"-volume.port={p.volume}",
            f"-volume.port.grpc={p.volume_grpc}",
            "-volume.preStopSeconds=0",
            f"-filer.port={p.filer}",
            f"-filer.port.grpc={p.filer_grpc}",
            "-s3",
            f"-s3.port={p.s3}",
            f"-s3.port.grpc={p.s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *([f"-s3.config={self.s3_config}"] if self.s3_config is not None else []),
        ]

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (dummy credentials, path-style, no retries)."""
        defaults: dict[str, Any] = {
            "s3": {"addressing_style": "path"},
            "retries": {"mode": "standard", "total_max_attempts": 1},
            "connect_timeout": 2,
            "read_timeout": 10,
        }
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=DUMMY_ACCESS_KEY,
            aws_secret_access_key=DUMMY_SECRET_KEY,
            region_name=REGION,
            config=Config(**{**defaults, **config}),
        )

    def start(self) -> None:
        """Start the server and wait until S3 answers; raise with the log tail if it does not.

        A port picked free can be taken by another process before ``weed`` binds it (test
        workers start servers at once): a first start that fails so picks new ports and tries
        again. A restart keeps its ports, which clients already know.
        """
        for attempt in range(3):
            try:
                self._start_once()
                return
            except SeaweedStartupError:
                taken = "address already in use" in self.log_tail(200).lower()
                if self.start_seconds or not taken or attempt == 2:
                    raise
                self.ports = SeaweedPorts.pick_free()

    def _start_once(self) -> None:
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        # One volume per bucket instead of seven: tests make many small buckets.
        env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- cas: starting {' '.join(self.command())}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.data_dir,
                start_new_session=True,
                env=env,
                preexec_fn=_die_with_parent,
            )
        try:
            self._wait_until_ready()
        except BaseException:
            self._kill()
            raise
        self.start_seconds.append(time.monotonic() - began)

    def _wait_until_ready(self) -> None:
        client = self.client(connect_timeout=1, read_timeout=2)
        deadline = time.monotonic() + self.startup_timeout
        last_error = "no attempt made"
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise SeaweedStartupError(
                    f"weed server exited with code {self._process.returncode}\n{self.log_tail()}"
                )
            try:
                client.list_buckets()
                if self._volume_servers() > 0:
                    return
                last_error = "no volume server registered with the master yet"
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
                last_error = str(e)
            except OSError as e:
                last_error = f"master status: {e}"
            time.sleep(0.1)
        raise SeaweedStartupError(
            f"S3 at {self.endpoint_url} did not answer within {self.startup_timeout:.0f} s "
            f"({last_error})\n{self.log_tail()}"
        )

    def _volume_servers(self) -> int:
        # S3 answers before the volume server's heartbeat reaches a restarted master; until then
        # reads of existing objects fail with InternalError.
        url = f"http://127.0.0.1:{self.ports.master}/dir/status"
        with urllib.request.urlopen(url, timeout=2) as response:
            status = json.load(response)
        return sum(
            len(rack.get("DataNodes") or [])
            for center in status["Topology"].get("DataCenters") or []
            for rack in center.get("Racks") or []
        )

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def make_bucket(self, name: str) -> str:
        """Create a bucket (no error if it exists) and return its name."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass
        return name

    def stop(self) -> None:
        """SIGTERM, wait ``grace`` seconds, then SIGKILL; a no-op if not running."""
        process = self._process
        if process is None:
            return
        began = time.monotonic()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                self._kill()
        self._process = None
        self.stop_seconds.append(time.monotonic() - began)

    def kill(self) -> None:
        """SIGKILL the server now, as a crash would (no graceful stop); ``start()`` brings the
        same store back on the same ports."""
        self._kill()
        self._process = None

    def _kill(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=30)

    def restart(self) -> None:
        """Stop and start again on the same data directory and ports."""
        self.stop()
        self.start()

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
