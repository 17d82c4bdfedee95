"""A small HTTP server on 127.0.0.1 for the web tools' tests (tests/unit/test_web_tools.py,
tests/e2e/test_web_tools.py): the test fills in its paths; nothing here leaves 127.0.0.1."""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Route = Callable[["Handler"], None]


@dataclass
class Site:
    """An HTTP server on 127.0.0.1 whose paths the test fills in."""

    server: ThreadingHTTPServer
    routes: dict[str, Route] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Any

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        site: Site = self.server.site
        site.requests.append(self.path)
        route = site.routes.get(urlsplit(self.path).path)
        if route is None:
            self.reply(404, b"<html><body><h1>Not here</h1><p>No page at this address.</p></body></html>")
        else:
            route(self)

    def reply(self, status: int, body: bytes, content_type: str = "text/html; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serve() -> Iterator[Site]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    site = server.site = Site(server)  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield site
    finally:
        site.stop.set()
        server.shutdown()
        server.server_close()



def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def page(body: bytes, content_type: str = "text/html; charset=utf-8", status: int = 200,
         headers: dict[str, str] | None = None) -> Route:
    return lambda h: h.reply(status, body, content_type, headers)


def redirect(status: int, location: str) -> Route:
    return lambda h: h.reply(status, b"moved", "text/plain", {"Location": location})


def endless(h: Handler) -> None:
    """A text response that never ends (HTTP/1.0, no length): sent until the reader hangs up."""
    h.send_response(200)
    h.send_header("Content-Type", "text/plain")
    h.end_headers()
    chunk = b"all work and no play makes jack a dull boy\n" * 1000
    try:
        while not h.server.site.stop.is_set():
            h.wfile.write(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass


def stall(arrived: threading.Event, hung_up: threading.Event) -> Route:
    """Headers, then nothing: waits until the client closes the connection."""
    def route(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/html")
        h.end_headers()
        h.wfile.write(b"<p>first bytes")
        h.wfile.flush()
        arrived.set()
        while not h.server.site.stop.is_set():
            readable, _, _ = select.select([h.connection], [], [], 0.2)
            if readable and h.connection.recv(1024) == b"":
                hung_up.set()
                return
    return route


def searxng(answer: Any, seen: list[dict[str, list[str]]], status: int = 200, content_type: str = "application/json") -> Route:
    def route(h: Handler) -> None:
        seen.append(parse_qs(urlsplit(h.path).query))
        body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        h.reply(status, body, content_type)
    return route


# A SearXNG JSON answer (GET /search?q=...&format=json), with the odd entries real ones have.
RESULTS = {
    "query": "sandbox egress",
    "number_of_results": 1234,
    "results": [
        {"url": "https://one.example/a", "title": "First  <b>result</b>", "content": "About   sandboxes\nand egress.",
         "engine": "duckduckgo", "publishedDate": "2026-03-04T10:00:00"},
        {"url": "https://two.example/b", "title": "", "content": ""},
        {"title": "no url: skipped"},
        {"url": "https://three.example/c", "title": "Third", "content": "x" * 600},
    ],
    "answers": ["42"],
    "suggestions": ["sandbox proxy", "egress filtering"],
    "unresponsive_engines": [],
}
