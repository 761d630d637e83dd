"""The ``cas ui`` server: a read-only web view of one store, for this machine's user only.

Like Jupyter's, the server binds to 127.0.0.1 and answers only a request that carries its random
token: in the URL it prints (``?token=...``; an HTML page then sets it as a same-site, HTTP-only
cookie and redirects to the URL without it, so it leaves no trace in the address bar), in that
cookie, or in an ``Authorization: token ...`` header. It also refuses a ``Host`` header that names
another machine while bound to loopback, so a web page elsewhere cannot reach it by DNS
rebinding. Every route answers HTML, or JSON to ``Accept: application/json`` (or
``?format=json``). Pages carry no script and the content security policy forbids any. Only GET and
HEAD are served; the store is opened read-only.
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode, urlsplit

from cas.errors import CASError, NotFound
from cas.ui import pages, views
from cas.ui.snapshots import Snapshots

if TYPE_CHECKING:
    from cas.repo.repository import Repository

COOKIE = "cas_ui_token"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
STATIC = {"/static/style.css": "text/css; charset=utf-8"}


@dataclass(frozen=True)
class Route:
    """A view: the data it shows (from the query), how that renders, and the page's title."""

    data: Callable[[Repository, Snapshots, dict[str, str]], dict[str, Any]]
    render: Callable[[dict[str, Any]], str]
    title: Callable[[dict[str, str]], str]


def _page(query: dict[str, str]) -> int:
    try:
        return int(query.get("page", "1"))
    except ValueError:
        return 1


def _required(query: dict[str, str], name: str) -> str:
    value = query.get(name)
    if not value:
        raise NotFound(f"this page needs ?{name}=")
    return value


ROUTES: dict[str, Route] = {
    "/": Route(lambda r, s, q: views.runs_index(r, s, _page(q)), pages.runs_page, lambda q: "Runs"),
    "/run": Route(
        lambda r, s, q: views.run_detail(r, _required(q, "name"), _page(q)),
        pages.run_page,
        lambda q: f"Run {q.get('name', '')}",
    ),
    "/checkpoint": Route(
        lambda r, s, q: views.checkpoint_detail(r, _required(q, "ref"), s, _page(q)),
        pages.checkpoint_page,
        lambda q: q.get("ref", "Checkpoint"),
    ),
    "/storage": Route(lambda r, s, q: views.storage(r, s), pages.storage_page, lambda q: "Storage"),
    "/retention": Route(
        lambda r, s, q: views.retention(r, s, _page(q)), pages.retention_page, lambda q: "Retention"
    ),
    "/pools": Route(
        lambda r, s, q: views.pools(r, s), pages.pools_page, lambda q: "Opponent pools"
    ),
}


class UIServer:
    """``cas ui``'s HTTP server over one read-only repository."""

    def __init__(
        self,
        repo: Repository,
        *,
        label: str,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.repo = repo
        self.label = label
        self.token = token or secrets.token_urlsafe(24)
        self.log = log
        self.snapshots = Snapshots()
        self.httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self.httpd.daemon_threads = True
        self.host = host
        self.loopback = host in LOOPBACK_HOSTS

    @property
    def port(self) -> int:
        """The port bound (the one asked for, or a free one for 0)."""
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        """The URL to open: the server's address with its token."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/?{urlencode({'token': self.token})}"

    def serve_forever(self) -> None:
        """Answer requests until ``shutdown`` (or Ctrl-C in the caller)."""
        self.httpd.serve_forever(poll_interval=0.2)

    def warm(self) -> threading.Thread:
        """Compute the whole-store snapshots in the background, so the first visit to the
        storage and retention pages finds them ready."""
        thread = threading.Thread(
            target=views.warm, args=(self.repo, self.snapshots), name="cas-ui-warm", daemon=True
        )
        thread.start()
        return thread

    def start(self) -> threading.Thread:
        """Serve on a daemon thread (tests, embedding)."""
        thread = threading.Thread(target=self.serve_forever, name="cas-ui", daemon=True)
        thread.start()
        return thread

    def shutdown(self) -> None:
        """Stop serving and close the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def authorized(self, supplied: str | None) -> bool:
        """Whether ``supplied`` is the token (compared in constant time)."""
        return supplied is not None and hmac.compare_digest(supplied.encode(), self.token.encode())


def _handler_for(server: UIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        ui = server

    return Handler


class _Handler(BaseHTTPRequestHandler):
    ui: UIServer
    server_version = "cas-ui"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        if self.ui.log is not None:  # never the query: it may hold the token
            self.ui.log(
                f"{self.command} {urlsplit(self.path).path} {args[1] if len(args) > 1 else ''}"
            )

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _refuse_method(self) -> None:
        self._send(
            HTTPStatus.METHOD_NOT_ALLOWED,
            b"read-only: GET and HEAD only\n",
            "text/plain",
            head=False,
            extra={"Allow": "GET, HEAD"},
        )

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_method

    def _answer(self, *, head: bool) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        wants_json = query.get("format") == "json" or _prefers_json(self.headers.get("Accept", ""))
        if self.ui.loopback and not _loopback_host(self.headers.get("Host", "")):
            self._error(
                HTTPStatus.FORBIDDEN,
                "this server answers only requests for localhost",
                wants_json,
                head,
            )
            return
        supplied = query.get("token") or self._cookie_token() or self._header_token()
        if not self.ui.authorized(supplied):
            self._error(
                HTTPStatus.FORBIDDEN,
                "a token is required: open the URL `cas ui` printed",
                wants_json,
                head,
            )
            return
        if "token" in query and not wants_json:
            rest = urlencode({k: v for k, v in query.items() if k != "token"})
            cookie = f"{COOKIE}={self.ui.token}; HttpOnly; SameSite=Strict; Path=/"
            self._send(HTTPStatus.SEE_OTHER, b"", "text/plain", head=True,
                       extra={"Location": parts.path + (f"?{rest}" if rest else ""), "Set-Cookie": cookie})  # fmt: skip
            return
        if parts.path in STATIC:
            body = (
                resources.files("cas.ui")
                .joinpath("static", parts.path.rsplit("/", 1)[1])
                .read_bytes()
            )
            self._send(HTTPStatus.OK, body, STATIC[parts.path], head=head)
            return
        route = ROUTES.get(parts.path)
        if route is None:
            self._error(HTTPStatus.NOT_FOUND, f"no page {parts.path}", wants_json, head)
            return
        try:
            data = route.data(self.ui.repo, self.ui.snapshots, query)
        except NotFound as e:
            self._error(HTTPStatus.NOT_FOUND, str(e), wants_json, head)
            return
        except CASError as e:
            self._error(
                HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}", wants_json, head
            )
            return
        except Exception as e:  # a bug: tell the operator in full, the page in one line
            traceback.print_exc(file=sys.stderr)
            self._error(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                f"internal error: {type(e).__name__}: {e}",
                wants_json,
                head,
            )
            return
        if wants_json:
            self._send(HTTPStatus.OK, _json(data), "application/json", head=head)
            return
        html = pages.document(
            route.title(query), self.ui.label, route.render(data), active=parts.path
        )
        self._send(HTTPStatus.OK, html.encode(), "text/html; charset=utf-8", head=head)

    def _cookie_token(self) -> str | None:
        try:
            jar = SimpleCookie(self.headers.get("Cookie", ""))
        except CookieError:
            return None
        morsel = jar.get(COOKIE)
        return morsel.value if morsel is not None else None

    def _header_token(self) -> str | None:
        kind, _, value = self.headers.get("Authorization", "").partition(" ")
        return value.strip() if kind.lower() in ("token", "bearer") and value else None

    def _error(self, status: HTTPStatus, message: str, wants_json: bool, head: bool) -> None:
        if wants_json:
            body = _json({"error": message, "status": int(status)})
            self._send(status, body, "application/json", head=head)
        else:
            html = pages.error_page(int(status), message, self.ui.label)
            self._send(status, html.encode(), "text/html; charset=utf-8", head=head)

    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        kind: str,
        *,
        head: bool,
        extra: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in {**SECURITY_HEADERS, **(extra or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


def _prefers_json(accept: str) -> bool:
    """Whether ``Accept`` asks for JSON before HTML (a browser's asks for HTML first)."""
    kinds = [part.split(";")[0].strip().lower() for part in accept.split(",")]
    for kind in kinds:
        if kind == "application/json":
            return True
        if kind in ("text/html", "application/xhtml+xml"):
            return False
    return False


def _loopback_host(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name.lower() in LOOPBACK_HOSTS


def _json(data: Any) -> bytes:
    return json.dumps(_finite(data), default=str, allow_nan=False).encode() + b"\n"


def _finite(value: Any) -> Any:
    """NaN and infinities (a diverged loss) as null: JSON has no word for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
