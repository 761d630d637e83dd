"""LossyProxy: a loopback HTTP proxy in front of an S3 server that loses replies after the fact.

Each request is forwarded to the real server and its answer read in full, so the server has done
the work (a conditional write has landed); then, for the requests a ``LossRule`` picks, the
client never learns it: the connection is closed without an answer (``mode="close"``, what a
reset connection or a crashed load balancer looks like) or a 500 ``InternalError`` is sent
instead (``mode="500"``). Which requests lose their replies is decided by a seeded RNG, so a
run can be repeated. Point a store at ``proxy.url`` as its endpoint.
"""

from __future__ import annotations

import http.client
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
)
INTERNAL_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>reply lost by LossyProxy</Message></Error>"
)


def writes_key(
    key: str, *, method: str = "PUT", conditional: bool = True
) -> Callable[[Request], bool]:
    """A ``LossRule.select`` picking the (conditional) ``method`` requests on the blob ``key``."""

    def select(request: Request) -> bool:
        path = unquote(request.path.split("?", 1)[0])
        return (
            request.method == method
            and path.endswith("/" + key)
            and (request.conditional or not conditional)
        )

    return select


@dataclass(frozen=True)
class Request:
    """What the proxy saw of one request."""

    method: str
    path: str
    """The path and query, ``/bucket/prefix/key?...``."""
    headers: dict[str, str]
    """Header names in lower case."""

    @property
    def conditional(self) -> bool:
        """Whether it carries ``If-Match`` or ``If-None-Match`` (a compare-and-swap, a create)."""
        return "if-match" in self.headers or "if-none-match" in self.headers


@dataclass
class LossRule:
    """Which replies to lose: a ``fraction`` of the requests ``select`` picks, at most ``limit``."""

    fraction: float = 0.0
    select: Callable[[Request], bool] = lambda request: True
    limit: int | None = None
    mode: str = "close"
    """``close``: drop the connection unanswered; ``500``: answer InternalError instead;
    ``both``: either, half of the time each."""
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("close", "500", "both"):
            raise ValueError(f"unknown loss mode {self.mode!r}")
        self._rng = random.Random(self.seed)


class LossyProxy:
    """Forwards to ``upstream`` (``http://host:port``) and loses the replies ``rule`` picks.

    ``lost`` lists the requests whose replies were lost, ``forwarded`` counts every request.
    Use as a context manager, or ``start``/``stop``.
    """

    def __init__(self, upstream: str, rule: LossRule | None = None) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"LossyProxy forwards plain http only, not {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self.rule = rule or LossRule()
        self.lost: list[Request] = []
        self.forwarded = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The endpoint URL a client uses."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def set_rule(self, rule: LossRule) -> None:
        """Lose replies by ``rule`` from now on."""
        with self._lock:
            self.rule = rule

    def loss(self, request: Request) -> str | None:
        """How this request's reply is lost (``close`` or ``500``), or None; counts it."""
        with self._lock:
            self.forwarded += 1
            rule = self.rule
            if rule.limit is not None and rule.limit <= 0:
                return None
            if not rule.select(request) or rule._rng.random() >= rule.fraction:
                return None
            if rule.limit is not None:
                rule.limit -= 1
            self.lost.append(request)
            if rule.mode == "both":
                return "close" if rule._rng.random() < 0.5 else "500"
            return rule.mode

    def start(self) -> LossyProxy:
        """Serve on a background thread."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="lossy-proxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> LossyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler_for(proxy: LossyProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(_ForwardingHandler):
        owner = proxy

    return Handler


class _ForwardingHandler(BaseHTTPRequestHandler):
    """One client connection: each request forwarded on a connection of its own upstream."""

    protocol_version = "HTTP/1.1"  # keep-alive, and ``Expect: 100-continue`` answered here
    owner: LossyProxy
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the tests count requests instead."""

    def finish(self) -> None:
        """Close the upstream connection with the client's."""
        super().finish()
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        request = Request(self.command, self.path, headers)
        status, reason, reply_headers, reply = self._ask_upstream(request, body)
        loss = self.owner.loss(request)
        if loss is not None:
            if loss == "close":
                self.close_connection = True
                return  # the handler closes the socket: the client sees no answer at all
            status, reason, reply = 500, "Internal Server Error", INTERNAL_ERROR
            reply_headers = [("Content-Type", "application/xml")]
        self.send_response_only(status, reason)
        sent_length = False
        for name, value in reply_headers:
            if name.lower() in HOP_BY_HOP:
                continue
            if name.lower() == "content-length":
                if self.command != "HEAD":
                    continue  # re-framed below: the body was read whole
                sent_length = True
            self.send_header(name, value)
        if not sent_length:
            self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply)

    def _ask_upstream(
        self, request: Request, body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        upstream = self._send_upstream(request, body)
        try:
            response = upstream.getresponse()
            return response.status, response.reason, response.getheaders(), response.read()
        except BaseException:
            upstream.close()
            self._upstream = None
            raise  # the client sees its connection closed: a lost reply all the same

    def _send_upstream(self, request: Request, body: bytes) -> http.client.HTTPConnection:
        """The request sent upstream, on the kept connection or, if the server closed that one
        while it was idle (the send fails, nothing was processed), on a new one."""
        for attempt in (1, 2):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(
                    self.owner.upstream_host, self.owner.upstream_port, timeout=120
                )
            upstream = self._upstream
            try:
                upstream.putrequest(
                    request.method, request.path, skip_host=True, skip_accept_encoding=True
                )
                for name, value in self.headers.items():
                    if name.lower() not in HOP_BY_HOP:
                        upstream.putheader(name, value)
                upstream.endheaders(body if body else None)
                return upstream
            except (http.client.HTTPException, OSError):
                upstream.close()
                self._upstream = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    do_GET = _forward
    do_PUT = _forward
    do_POST = _forward
    do_DELETE = _forward
    do_HEAD = _forward
