"""`sandboxd mcp --http` bounded before the token: a flood of silent or half-sent connections, and sessions.

The server runs under a small open-file limit (prlimit), so that a flood would exhaust it:
without the bounds, accept() fails with EMFILE and the client with the token is never served.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import threading
import time
from typing import Any

import anyio
import httpx2
import pytest

from tests.e2e.mcp_session import TOKEN, HttpServer, free_port, mcp_command, server_env, text_of

pytestmark = pytest.mark.docker

FAST = "pool:\n  min_idle: 1\n  shutdown_grace_s: 0.5\n"
NOFILE = 256
HEAD_TIMEOUT_S = 2.0
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                         "clientInfo": {"name": "probe", "version": "1"}}}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
           "Authorization": f"Bearer {TOKEN}"}


class LimitedServer(HttpServer):
    """HttpServer under ``prlimit --nofile`` (NOFILE by default), with its descriptors counted."""

    def __init__(self, daemon: Any, *args: str, nofile: int = NOFILE) -> None:
        super().__init__(daemon, *args, nofile=nofile)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


class Flood:
    """Connections to ``port`` that send nothing, or half a request head without a token; kept open by this side."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sockets: list[socket.socket] = []
        self.failed = 0  # connects that did not complete within 3 s (a server that stopped accepting)

    def open(self, count: int) -> None:
        half_head = b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n" % self.port
        for n in range(count):
            sock = socket.socket()
            sock.settimeout(3)  # a SYN dropped from a full queue is sent again after 1 s
            try:
                sock.connect(("127.0.0.1", self.port))
                if n % 2:
                    sock.sendall(half_head)
            except OSError:
                sock.close()
                self.failed += 1
                if self.failed >= 5:
                    return  # bounded in time: the server is not accepting
                continue
            self.sockets.append(sock)

    def still_open(self) -> int:
        """How many the server has not closed (a read would block, rather than see EOF or a reset)."""
        open_count = 0
        for sock in self.sockets:
            sock.setblocking(False)
            try:
                sock.recv(1 << 16)  # EOF, or an answer before one (a 503 to a newcomer): not held
            except BlockingIOError:
                open_count += 1
            except OSError:
                continue  # reset: closed
        return open_count

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


@pytest.fixture
def many_fds() -> None:
    """This test process holds thousands of client sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"this process may open {hard} files; the flood needs 8192")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 8192), hard))


def test_a_flood_of_silent_connections_does_not_starve_the_client_with_the_token(make_daemon: Any,
                                                                                 many_fds: None) -> None:
    daemon = make_daemon(FAST)
    server = LimitedServer(daemon, "--head-timeout", str(HEAD_TIMEOUT_S))
    flood = Flood(server.port)
    try:
        started = time.monotonic()
        flood.open(2000)
        flooded_s = time.monotonic() - started
        peak_fds = server.fds()
        print(f"2000 connections opened in {flooded_s:.2f} s ({flood.failed} failed); server fds {peak_fds}")
        assert flood.failed == 0, f"{flood.failed} connects failed: the server stopped accepting\n{server.log.read_text()}"
        more = threading.Thread(target=flood.open, args=(1000,))  # and it goes on while the client works

        async def served() -> None:
            with anyio.fail_after(30):
                async with server.session("legacy") as session:
                    names = {tool.name for tool in (await session.list_tools()).tools}
                    assert "hello" in names, names
                    result = await session.call_tool("hello", {"name": "flood"})
                    assert text_of(result) == "Hello, flood!"

        more.start()
        began = time.monotonic()
        anyio.run(served)
        print(f"token holder served in {time.monotonic() - began:.2f} s during the flood")
        more.join(60)
        assert flood.failed == 0, f"{flood.failed} connects failed: the server stopped accepting"
        assert server.fds() < NOFILE, server.fds()
        # Silent and half-sent ones are closed by the head deadline, whether or not the cap reached them.
        deadline = time.monotonic() + HEAD_TIMEOUT_S + 3
        while (left := flood.still_open()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == 0, f"{left} connections without a request head still open {HEAD_TIMEOUT_S + 3} s on"
        print(f"server fds after the head deadline: {server.fds()}")
        assert server.fds() < 40, server.fds()
        log = server.log.read_text()
        assert "Too many open files" not in log and "out of system resource" not in log, log[-3000:]
        assert "mcp_http_connections_bounded" in log, log[-3000:]
    finally:
        flood.close()
        server.stop()


def test_a_connection_trickling_its_head_is_closed_at_the_deadline(make_daemon: Any) -> None:
    daemon = make_daemon(FAST)
    server = HttpServer(daemon, "--head-timeout", str(HEAD_TIMEOUT_S))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as slow:
            started = time.monotonic()
            head = b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 100
            closed_after = None
            for byte in head:  # a byte every 0.2 s: each one used to reset uvicorn's timer
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed_after = time.monotonic() - started
                    break
                time.sleep(0.2)
            assert closed_after is not None, "a connection trickling its head was kept open"
            assert closed_after < HEAD_TIMEOUT_S + 1.5, closed_after
    finally:
        server.stop()


def test_sessions_past_the_cap_are_refused_plainly_and_idle_ones_expire(make_daemon: Any) -> None:
    daemon = make_daemon(FAST)
    server = HttpServer(daemon, "--max-sessions", "3", "--session-idle-timeout", "2")
    try:
        sessions = []
        for _ in range(3):
            opened = httpx2.post(server.url, headers=HEADERS, content=json.dumps(INITIALIZE), timeout=10)
            assert opened.status_code == 200, opened.text
            sessions.append(opened.headers["mcp-session-id"])
        refused = httpx2.post(server.url, headers=HEADERS, content=json.dumps(INITIALIZE), timeout=10)
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "holds 3 sessions (--max-sessions)" in message and "--session-idle-timeout" in message, message
        time.sleep(3.5)  # idle past the timeout: each session is ended, and its room freed
        ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        for session_id in sessions:
            gone = httpx2.post(server.url, headers={**HEADERS, "Mcp-Session-Id": session_id,
                                                    "Mcp-Protocol-Version": "2025-11-25"},
                               content=json.dumps(ping), timeout=10)
            assert gone.status_code == 404, gone.text

        async def served() -> None:
            with anyio.fail_after(30):
                async with server.session("legacy") as session:
                    assert text_of(await session.call_tool("hello", {"name": "again"})) == "Hello, again!"

        anyio.run(served)
    finally:
        server.stop()


def test_bounds_out_of_range_are_refused_at_start(make_daemon: Any) -> None:
    daemon = make_daemon(FAST, start=False)
    env = server_env({"SANDBOXD_MCP_TOKEN": TOKEN})
    for flag, value in (("--max-connections", "2"), ("--head-timeout", "0"), ("--max-sessions", "0"),
                        ("--session-idle-timeout", "nan")):
        run = subprocess.run(mcp_command(daemon, "--http", f"127.0.0.1:{free_port()}", flag, value),
                             capture_output=True, env=env, timeout=30)
        assert run.returncode == 2 and f"{flag} " in run.stderr.decode(), (flag, run.stderr.decode())
    tight = subprocess.run(["prlimit", "--nofile=40:40", "--",
                            *mcp_command(daemon, "--http", f"127.0.0.1:{free_port()}")],
                           capture_output=True, env=env, timeout=30)
    assert tight.returncode == 2 and "open-file limit (40)" in tight.stderr.decode(), tight.stderr.decode()
