"""The browser relay, end to end (issue 26, part 3): a real daemon, real sandboxes, a relay on 127.0.0.1.

The platform's browser tools connect to ``127.0.0.1:$OFFICER_BROWSER_RELAY_PORT``. The relay here
is this test's own: a line echo on one port and a real WebSocket server (the ``websockets``
package) on the next, both on 127.0.0.1, named to the daemon as ``integrations.browser_relay:
127.0.0.1:FIRST-LAST``; a decoy listens on another port of 127.0.0.1 that the range does not cover.
Nothing here leaves the machine: the only servers connected to are these, and every daemon runs
under tests/netguard (loopback only).
"""

from __future__ import annotations

import asyncio
import json
import socket
import socketserver
import threading
import time
from typing import Any, Iterator

import pytest
from websockets.asyncio.server import ServerConnection, serve

from tests.e2e.conftest import Daemon, write_tool

pytestmark = pytest.mark.docker

USER = "relay@example.com"
SETTING = "integrations.browser_relay"
RELAY_NAME = "browser-relay.sandboxd.invalid"


class _Echo(socketserver.StreamRequestHandler):
    server: _EchoServer

    def handle(self) -> None:
        self.server.connections += 1
        for line in self.rfile:
            self.server.lines.append(line)
            self.wfile.write(b"echo: " + line)
        self.server.closed.append(time.monotonic())  # when the tunnel's far end saw it end


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    connections = 0
    lines: list[bytes]
    closed: list[float]


class Relay:
    """A relay on two adjacent ports of 127.0.0.1 (line echo, then WebSocket), and a decoy elsewhere."""

    def __init__(self) -> None:
        self.echo, ws_socket = self._adjacent()
        self.echo.lines, self.echo.closed = [], []
        self.tcp_port = self.echo.server_address[1]
        self.ws_port = ws_socket.getsockname()[1]
        self.paths: list[str] = []
        self.messages: list[str] = []
        threading.Thread(target=self.echo.serve_forever, daemon=True).start()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Future[None] | None = None
        threading.Thread(target=self._loop.run_until_complete, args=(self._serve(ws_socket),), daemon=True).start()
        assert self._ready.wait(10), "the WebSocket server did not start"
        self.decoy = socket.create_server(("127.0.0.1", 0))
        self.decoy_port = self.decoy.getsockname()[1]
        self.decoy.settimeout(0)

    @property
    def setting(self) -> str:
        return f"127.0.0.1:{self.tcp_port}-{self.ws_port}"

    @staticmethod
    def _adjacent() -> tuple[_EchoServer, socket.socket]:
        for _ in range(50):
            echo = _EchoServer(("127.0.0.1", 0), _Echo)
            try:
                return echo, socket.create_server(("127.0.0.1", echo.server_address[1] + 1))
            except OSError:
                echo.server_close()
        raise AssertionError("no two adjacent free ports on 127.0.0.1")

    async def _handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        self.paths.append(ws.request.path)
        await ws.send("hello from the relay")
        async for message in ws:
            self.messages.append(str(message))
            await ws.send(f"echo: {message}")

    async def _serve(self, sock: socket.socket) -> None:
        self._stop = self._loop.create_future()
        async with serve(self._handler, sock=sock):
            self._ready.set()
            await self._stop

    def decoy_connections(self) -> int:
        count = 0
        while True:
            try:
                conn, _ = self.decoy.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1

    def close(self) -> None:
        self.echo.shutdown()
        self.echo.server_close()
        self.decoy.close()
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set_result, None)


@pytest.fixture
def relay() -> Iterator[Relay]:
    server = Relay()
    yield server
    server.close()


def probe(daemon: Daemon, mode: str, port: int | None, *, tool: str = "relay_probe", **arguments: Any) -> dict[str, Any]:
    """``tool`` in a call whose env sets OFFICER_BROWSER_RELAY_PORT to ``port`` (None: not set)."""
    env = {} if port is None else {"OFFICER_BROWSER_RELAY_PORT": str(port)}
    with daemon.client() as client:
        result = client.call_tool(USER, tool, {"mode": mode, **arguments}, env=env, timeout_ms=60_000)
    assert result["status"] == "ok", result
    return json.loads(result["content"][0]["text"])


def ask(daemon: Daemon, request: str, port: int | None) -> str:
    """What the egress socket answers ``request`` (egress_probe's raw mode), in a call given ``port``."""
    return str(probe(daemon, "raw", port, tool="egress_probe", request=request)["answer"])


def relaying(make_daemon: Any, relay: Relay, **env: str) -> Daemon:
    return make_daemon(env={"SANDBOXD_INTEGRATIONS_BROWSER_RELAY": relay.setting, **env})


def test_the_relay_is_reached_on_its_port_raw_tcp_and_websocket(make_daemon: Any, relay: Relay) -> None:
    daemon = relaying(make_daemon, relay)
    for host in ("127.0.0.1", "localhost"):
        assert probe(daemon, "tcp", relay.tcp_port, host=host) == {"reply": "echo: round trip"}
    assert relay.echo.connections == 2

    ws = probe(daemon, "websocket", relay.ws_port)
    assert ws == {"status": 101, "acceptOk": True, "hello": "hello from the relay", "echo": "echo: ping from the sandbox"}
    # The http module's upgrade (its Agent tunnels through the egress socket) and fetch take the same way.
    assert probe(daemon, "http-upgrade", relay.ws_port, host="localhost") == ws
    fetched = probe(daemon, "fetch", relay.ws_port)
    assert fetched["status"] == 426, fetched  # the WebSocket server's answer to a plain GET
    assert relay.paths == ["/extension?token=relay-token", "/extension"]
    assert relay.messages == ["ping from the sandbox"] * 2

    # Logged and counted as egress: where the tunnel went, and why.
    allowed = daemon.events("egress", user=USER, decision="allowed", reason=SETTING)
    assert {(e["host"], e["port"], e["address"]) for e in allowed} == {
        ("127.0.0.1", relay.tcp_port, "127.0.0.1"), ("127.0.0.1", relay.ws_port, "127.0.0.1")}
    assert len(allowed) == 5 and {e["tool"] for e in allowed} == {"relay_probe"}
    assert relay.decoy_connections() == 0


def test_a_port_outside_the_range_reaches_nothing_and_says_why(make_daemon: Any, relay: Relay) -> None:
    daemon = relaying(make_daemon, relay)
    refused = probe(daemon, "tcp", relay.decoy_port)
    assert refused["code"] == "ECONNREFUSED", refused
    assert f"the port is outside {SETTING} ({relay.setting})" in refused["error"], refused
    # fetch to that port asks the daemon for the relay, which refuses it by name.
    fetched = probe(daemon, "fetch", relay.decoy_port)
    assert f"port {relay.decoy_port} is outside {SETTING} ({relay.setting})" in fetched["error"], fetched
    assert relay.decoy_connections() == 0 and relay.echo.connections == 0
    refusals = daemon.events("egress", user=USER, decision="refused", port=relay.decoy_port)
    assert refusals and refusals[-1]["host"] == "127.0.0.1", refusals


def test_no_relay_is_reached_when_the_setting_is_unset(make_daemon: Any, relay: Relay) -> None:
    daemon = make_daemon()
    refused = probe(daemon, "tcp", relay.tcp_port)
    assert refused["code"] == "ECONNREFUSED", refused
    assert f"this sandboxd has no browser relay ({SETTING} is not set" in refused["error"], refused
    websocket = probe(daemon, "websocket", relay.ws_port)
    assert websocket["code"] == "ECONNREFUSED" and f"{SETTING} is not set" in websocket["error"], websocket
    asked = ask(daemon, f"CONNECT {RELAY_NAME}:{relay.tcp_port} HTTP/1.1\r\n\r\n", relay.tcp_port)
    assert asked.startswith("HTTP/1.1 403") and f"{SETTING} is not set" in asked, asked
    assert relay.echo.connections == 0 and relay.paths == []


def test_a_hostile_tool_cannot_turn_the_relay_path_to_another_port_or_host(make_daemon: Any, relay: Relay) -> None:
    """The call is granted the echo port. On the egress socket directly, the tool asks for the relay on
    the range's other port, on a port outside it, for the host's loopback by address, and in proxy
    form; then, after its call, for the port it had. Only the granted port was ever connected."""
    daemon = relaying(make_daemon, relay)
    granted = relay.tcp_port

    other = ask(daemon, f"CONNECT {RELAY_NAME}:{relay.ws_port} HTTP/1.1\r\n\r\n", granted)
    assert other.startswith("HTTP/1.1 403"), other
    assert f"port {relay.ws_port} is not the running call's OFFICER_BROWSER_RELAY_PORT ({granted})" in other
    outside = ask(daemon, f"CONNECT {RELAY_NAME}:{relay.decoy_port} HTTP/1.1\r\n\r\n", granted)
    assert outside.startswith("HTTP/1.1 403") and f"is outside {SETTING}" in outside, outside
    loopback = ask(daemon, f"CONNECT 127.0.0.1:{granted} HTTP/1.1\r\n\r\n", granted)
    assert loopback.startswith("HTTP/1.1 403") and "loopback address" in loopback, loopback
    proxied = ask(daemon, f"GET http://{RELAY_NAME}:{granted}/ HTTP/1.1\r\nHost: {RELAY_NAME}\r\n\r\n", granted)
    assert proxied.startswith("HTTP/1.1 400") and "reached with CONNECT" in proxied, proxied
    ungranted = ask(daemon, f"CONNECT {RELAY_NAME}:{granted} HTTP/1.1\r\n\r\n", None)
    assert ungranted.startswith("HTTP/1.1 403") and "no call running with OFFICER_BROWSER_RELAY_PORT" in ungranted

    # After its call is answered, a timer the tool left asks for the port the call had.
    no_call = f"no call running with OFFICER_BROWSER_RELAY_PORT inside {SETTING}"
    probe(daemon, "later", granted, request=f"CONNECT {RELAY_NAME}:{granted} HTTP/1.1\r\n\r\n")
    deadline = time.monotonic() + 10
    while len(daemon.events("egress", reason=no_call)) < 2:  # the ungranted call's, then the timer's
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.1)
    assert {e["decision"] for e in daemon.events("egress", reason=no_call)} == {"refused"}

    assert relay.echo.connections == 0 and relay.paths == [] and relay.decoy_connections() == 0
    # The granted port itself still works, as the control.
    assert probe(daemon, "tcp", granted) == {"reply": "echo: round trip"}


def test_relay_connections_are_held_to_the_sandboxs_egress_budget(make_daemon: Any, relay: Relay) -> None:
    """egress.max_connections 2: two relay connections held open, the third is closed unanswered
    (the daemon answers the shim 503, logged); once they are closed, the relay is reached again.
    Its bytes go through the same splice relay and rate budget as every egress tunnel."""
    daemon = relaying(make_daemon, relay, SANDBOXD_EGRESS_MAX_CONNECTIONS="2")
    seen = probe(daemon, "hold", relay.tcp_port, count=2)
    assert seen["opened"] == ["echo: held 0", "echo: held 1"], seen
    assert "reply" not in seen["next"], seen  # reset or closed, depending on the race with its write
    assert relay.echo.connections == 2
    assert daemon.events("egress", user=USER, decision="refused", reason="too many connections")
    deadline = time.monotonic() + 10  # the held tunnels end once the relay has closed its side too
    while (again := probe(daemon, "tcp", relay.tcp_port)) != {"reply": "echo: round trip"}:
        assert time.monotonic() < deadline, again
        time.sleep(0.2)


KEEPER = r"""
import * as net from "node:net";

const kept = globalThis as any;  // the sandbox's process outlives the call: so does what a tool leaves here
const report = (value: unknown) => ({ content: [{ type: "text" as const, text: JSON.stringify(value) }] });
const until = async (done: () => boolean) => {
  for (const end = Date.now() + 10000; !done(); await new Promise((r) => setTimeout(r, 10))) {
    if (Date.now() > end) throw new Error("timed out");
  }
};

export async function execute(_id: string, params: { mode: string; port: number }) {
  if (params.mode === "open") {  // a tunnel to the relay, opened in this call and kept past its answer
    const sock = net.connect({ path: "/officer/run/egress.sock" });
    const tunnel = { sock, data: "", closed: false };
    sock.on("data", (d) => { tunnel.data += d.toString("latin1"); });
    sock.on("error", () => {});
    sock.on("close", () => { tunnel.closed = true; });
    sock.write(`CONNECT browser-relay.sandboxd.invalid:${params.port} HTTP/1.1\r\n\r\n`);
    await until(() => tunnel.data.includes("\r\n\r\n"));
    sock.write("held\n");
    await until(() => tunnel.data.includes("echo: held\n") || tunnel.closed);
    kept.tunnel = tunnel;
    return report({ data: tunnel.data });
  }
  const tunnel = kept.tunnel;  // a later call, granted another port: the old tunnel, written to again
  if (!tunnel) return report({ kept: false });
  const closedBefore = tunnel.closed, before = tunnel.data.length;
  if (!tunnel.closed) tunnel.sock.write("again\n");
  await new Promise((r) => setTimeout(r, 1500));
  return report({ kept: true, closedBefore, reply: tunnel.data.slice(before) });
}
"""


def test_a_tunnel_a_tool_keeps_past_its_call_ends_with_the_answer(make_daemon: Any, relay: Relay) -> None:
    """Issue 36, item 3: a grant ends with its call. The tool opens the relay in a call granted the echo
    port and returns with the tunnel open. The relay sees it closed within a second of the answer; a
    later call in the same sandbox, granted the other port, finds the old tunnel dead."""
    daemon = make_daemon(env={"SANDBOXD_INTEGRATIONS_BROWSER_RELAY": relay.setting}, start=False)
    write_tool(daemon.data / "tools", "tunnel_keeper", KEEPER,
               inputs="  mode:\n    type: string\n    description: open or reuse.\n"
                      "  port:\n    type: number\n    description: The relay port of the call.\n")
    daemon.start()

    def keeper(mode: str, port: int) -> dict[str, Any]:
        with daemon.client() as client:
            result = client.call_tool(USER, "tunnel_keeper", {"mode": mode, "port": port},
                                      env={"OFFICER_BROWSER_RELAY_PORT": str(port)}, timeout_ms=60_000)
        assert result["status"] == "ok", result
        return dict(json.loads(result["content"][0]["text"]))

    opened = keeper("open", relay.tcp_port)
    answered = time.monotonic()
    assert opened["data"].startswith("HTTP/1.1 200") and opened["data"].endswith("echo: held\n"), opened
    while not relay.echo.closed and time.monotonic() < answered + 5:
        time.sleep(0.02)
    assert relay.echo.closed, "the relay's connection is still open 5 s after the call's answer"
    assert relay.echo.closed[0] - answered < 1.0, f"closed {relay.echo.closed[0] - answered:.2f} s after the answer"

    later = keeper("reuse", relay.ws_port)
    assert later["kept"] is True, later  # the same sandbox: the tool's socket is still there, its tunnel is not
    assert later["reply"] == "" and relay.echo.lines == [b"held\n"], (later, relay.echo.lines)
    assert relay.echo.connections == 1
