"""`sandboxd mcp --http` bounded before the token: a flood of silent or half-sent connections, and sessions.

The server runs under a small open-file limit (prlimit), so that a flood would exhaust it:
without the bounds, accept() fails with EMFILE and the client with the token is never served.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import anyio
import h11
import httpx2
import pytest

from tests.e2e.conftest import REPO
from tests.e2e.mcp_session import TOKEN, HttpServer, free_port, mcp_command, server_env, text_of

pytestmark = pytest.mark.docker

FAST = "pool:\n  min_idle: 1\n  shutdown_grace_s: 0.5\n"
NOFILE = 256
HEAD_TIMEOUT_S = 2.0
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                         "clientInfo": {"name": "probe", "version": "1"}}}
# Item 5's flood: a small cap, so that each newcomer must close a connection even at a slower rate than 2,400/s.
FLOOD_CAP = 128
REQUESTS, ROUNDS, GAPPED = 600, 8, 12  # the token holder's back-to-back requests, in rounds; those 0.5 s apart
# The floor: the server's one thread spends ~0.5 ms on each refused request (h11 and the ASGI app), so the
# 1,000-1,700 connections/s this 2-core shared machine delivers take 0.5-0.9 of a core, and a request queued
# behind a run-queue turn waits tens of ms. Measured with the fix: p90 within 1.3x, p99 17-38 -> 25-57 ms.
P99_FLOOR_S = 0.030
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


class KeepAlive:
    """The token holder as HTTP/1.1 allows: one connection kept alive across requests, written raw (h11), so
    nothing hides a connection the server closed under it; after a failure it connects again and goes on."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.session: str | None = None
        self.failures: list[str] = []
        self._connect()

    def _connect(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        self.conn = h11.Connection(h11.CLIENT)

    def post(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """The JSON-RPC answer (None for a notification's 202); a failure is noted and the connection made again."""
        try:
            return self._exchange(json.dumps(message).encode())
        except (OSError, h11.ProtocolError, ValueError) as exc:
            self.failures.append(f"{message.get('method')}: {exc!r}")
            self.sock.close()
            self._connect()
            return None

    def _exchange(self, body: bytes) -> dict[str, Any] | None:
        headers = [("Host", f"127.0.0.1:{self.port}"), ("Authorization", f"Bearer {TOKEN}"),
                   ("Accept", "application/json, text/event-stream"), ("Content-Type", "application/json"),
                   ("Content-Length", str(len(body)))]
        if self.session:
            headers += [("Mcp-Session-Id", self.session), ("Mcp-Protocol-Version", "2025-11-25")]
        self.sock.sendall(self.conn.send(h11.Request(method="POST", target="/mcp", headers=headers))
                          + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))
        status, data = 0, b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                if not (received := self.sock.recv(1 << 16)):
                    raise ConnectionResetError("closed by the server before its answer")
                self.conn.receive_data(received)
            elif isinstance(event, h11.Response):
                status = event.status_code
                self.session = self.session or dict(event.headers).get(b"mcp-session-id", b"").decode() or None
            elif isinstance(event, h11.Data):
                data += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        self.conn.start_next_cycle()
        if status == 202:
            return None
        if status != 200:
            raise ValueError(f"HTTP {status}: {data[:300]!r}")
        lines = [line[5:] for line in data.splitlines() if line.startswith(b"data:")]  # an SSE answer, or plain JSON
        return json.loads(lines[-1] if lines else data)

    def timed_lists(self, count: int, gap_s: float = 0.0) -> list[float]:
        """Seconds each of ``count`` tools/list requests took, ``gap_s`` apart; failed ones are not timed."""
        took = []
        for n in range(count):
            time.sleep(gap_s)
            began = time.perf_counter()
            answer = self.post({"jsonrpc": "2.0", "id": n + 10, "method": "tools/list"})
            if answer is not None:
                assert "hello" in {tool["name"] for tool in answer["result"]["tools"]}, answer
                took.append(time.perf_counter() - began)
        return took


def p99(seconds: list[float]) -> float:
    return sorted(seconds)[max(0, round(len(seconds) * 0.99) - 1)]


def test_a_flood_without_the_token_never_closes_the_token_holders_keep_alive_connection(make_daemon: Any) -> None:
    """Issue 44, item 5: newcomers used to close the oldest idle connection, often the token holder's keep-alive
    one: under 2,400 connections/s 24 of 1,524 of its requests failed, and 15 of 30 sent 0.5 s apart.

    The quiet baseline is taken in blocks between the flood's, with the flood turned to a sink of its own: the
    machine carries the same load (it is shared, and its load drifts), only the server is spared."""
    daemon = make_daemon(FAST)
    server = HttpServer(daemon, "--max-connections", str(FLOOD_CAP))
    holder = KeepAlive(server.port)
    flood = None
    try:
        holder.post({**INITIALIZE, "params": {**INITIALIZE["params"], "clientInfo": {"name": "holder", "version": "1"}}})
        holder.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        holder.timed_lists(30)  # warm: the daemon's first list, the SDK's first session
        flood = subprocess.Popen([sys.executable, "-m", "tests.e2e.connection_flood", str(server.port),
                                  "--rate", "2400", "--hold", str(2 * FLOOD_CAP), "--seconds", "60"],
                                 cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding", "the flood did not start"
        quiet: list[float] = []
        flooded: list[float] = []
        for _ in range(ROUNDS):
            os.kill(flood.pid, signal.SIGUSR1)  # to its sink: the same load on the machine, the server spared
            quiet += holder.timed_lists(REQUESTS // ROUNDS)
            os.kill(flood.pid, signal.SIGUSR1)  # back to the server
            time.sleep(0.2)  # its cap full again
            flooded += holder.timed_lists(REQUESTS // ROUNDS)
        gapped = holder.timed_lists(GAPPED, gap_s=0.5)
        flood.stdin.close()  # type: ignore[union-attr]
        summary = json.loads(flood.stdout.read().splitlines()[-1])
        flood.wait(30)
        quiet_p99, flood_p99 = p99(quiet), p99(flooded)
        print(f"flood {summary}; token holder p99 quiet {quiet_p99 * 1e3:.1f} ms, flooded {flood_p99 * 1e3:.1f} ms, "
              f"{len(holder.failures)} of {REQUESTS + GAPPED} failed ({GAPPED - len(gapped)} of the {GAPPED} sent 0.5 s apart)")
        assert summary["closed_by_server"] > FLOOD_CAP, f"the flood did not keep the server at its cap: {summary}"
        assert not holder.failures, f"{len(holder.failures)} of {REQUESTS + GAPPED} failed: {holder.failures[:5]}"
        assert len(gapped) == GAPPED
        assert flood_p99 <= max(2 * quiet_p99, quiet_p99 + P99_FLOOR_S), (quiet_p99, flood_p99)
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
            flood.wait()
        holder.sock.close()
        server.stop()
