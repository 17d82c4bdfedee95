"""The server and call runner on the fake backend: the protocol in milliseconds.

The end-to-end suite proves the same against Docker; these pin the edge cases
(ordering, deadlines, cancellation races) cheaply and deterministically.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Callable


from sandboxd.config import load_config
from sandboxd.errors import SandboxFailed
from sandboxd.sandbox.backend import CallRequest
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.server.connection import LINES_PER_TURN, RefusedPeers
from sandboxd.server.rpc import Dispatcher
from sandboxd.server.server import Server
from sandboxd.service.peercred import PeerPolicy

USER = "alice@example.com"


def hello_tree(data: Path) -> None:
    tool = data / "tools" / "hello"
    tool.mkdir(parents=True)
    (tool / "TOOL.md").write_text(
        "---\nname: hello\ndescription: Says hello.\nversion: 1\ninputs:\n  name:\n    type: string\n"
        "    description: Who.\n  token:\n    type: string\n    description: A secret.\n    optional: true\n"
        "    sensitive: true\n---\n# Hello\n"
    )
    (tool / "index.ts").write_text("export async function execute() {}\n")


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def send(self, message: Any) -> None:
        data = message if isinstance(message, bytes) else json.dumps(message).encode() + b"\n"
        self.writer.write(data)

    async def read(self) -> dict[str, Any]:
        return json.loads(await asyncio.wait_for(self.reader.readline(), 5))

    async def request(self, method: str, params: Any = None, request_id: Any = 1) -> dict[str, Any]:
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        while True:
            reply = await self.read()
            if reply.get("id") == request_id:
                return reply


class Harness:
    def __init__(self, server: Server, backend: FakeBackend) -> None:
        self.server, self.backend = server, backend

    async def connect(self) -> Conn:
        reader, writer = await asyncio.open_unix_connection(str(self.server.config.socket))
        return Conn(reader, writer)


def serving(tmp_path: Path, handler: Callable[..., Any] | None = None, **config: Any) -> Callable[..., Any]:
    """Decorator: run the test coroutine against a started server with a fake backend."""

    def wrap(test: Callable[[Harness], Any]) -> None:
        async def main() -> None:
            hello_tree(tmp_path / "data")
            no_seed = tmp_path / "no-seed"  # a None override is dropped (load_config): the repo's seed would sync
            no_seed.mkdir(exist_ok=True)
            settings = {"data_path": tmp_path / "data", "socket": tmp_path / "s.sock", "seed_tools": no_seed,
                        "backend": "fake"} | config
            cfg = load_config(overrides=settings, environ={})
            backend = FakeBackend(handler) if handler else FakeBackend()
            server = Server(cfg, backend)
            await server.startup()
            try:
                await test(Harness(server, backend))
            finally:
                await server.shutdown()
            assert backend.sandboxes == {}

        asyncio.run(main())

    return wrap


async def ok_handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
    return {"status": "ok", "content": [{"type": "text", "text": f"Hello, {request.arguments['name']}!"}], "isError": False}


def test_call_ok_and_status(tmp_path: Path) -> None:
    @serving(tmp_path, ok_handler)
    async def _(h: Harness) -> None:
        conn = await h.connect()
        reply = await conn.request("tools/call", {"user": USER, "name": "hello", "arguments": {"name": "World"}})
        result = reply["result"]
        assert result["content"] == [{"type": "text", "text": "Hello, World!"}]
        assert (result["status"], result["isError"]) == ("ok", False)
        status = (await conn.request("sandbox/status", request_id=2))["result"]
        assert status["calls"] == {"ok": 1} and status["callsInFlight"] == 0
        assert status["limits"]["allowedEnv"] == h.server.config.calls.allowed_env  # what a client may pass on
        assert repr(h.server.pool).startswith("<Pool [starting: 0")


def test_listing_a_users_tools_warms_their_pool(tmp_path: Path) -> None:
    @serving(tmp_path, ok_handler)
    async def _(h: Harness) -> None:
        conn = await h.connect()
        await conn.request("tools/list")  # no user: nobody to warm
        assert h.backend.starts == 0
        reply = await conn.request("tools/list", {"user": USER}, request_id=2)
        assert [tool["name"] for tool in reply["result"]["tools"]] == ["hello"]
        for _ in range(100):  # the answer does not wait for the start: wait for its evidence
            if h.server.pool.status()["users"].get(USER, {}).get("idle") == 1:
                break
            await asyncio.sleep(0.01)
        assert h.server.pool.status()["users"][USER]["idle"] == 1
        h.backend.unavailable()  # from here no sandbox can start: the call must find the warmed one
        reply = await conn.request("tools/call", {"user": USER, "name": "hello", "arguments": {"name": "W"}}, request_id=3)
        assert reply["result"]["status"] == "ok"


def test_progress_before_result_with_request_id_token(tmp_path: Path) -> None:
    async def handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
        for i in range(3):
            on_progress([{"type": "text", "text": str(i)}])
            await asyncio.sleep(0)
        return {"status": "ok", "content": [], "isError": False}

    @serving(tmp_path, handler)
    async def _(h: Harness) -> None:
        conn = await h.connect()
        conn.send({"jsonrpc": "2.0", "id": "r1", "method": "tools/call",
                   "params": {"user": USER, "name": "hello", "arguments": {"name": "x"}}})
        messages = [await conn.read() for _ in range(4)]
        assert [m["params"]["progress"] for m in messages[:3]] == [1, 2, 3]
        assert {m["params"]["progressToken"] for m in messages[:3]} == {"r1"}
        assert messages[3]["id"] == "r1"


def test_timeout_answers_at_the_deadline_and_discards_the_sandbox(tmp_path: Path) -> None:
    async def handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    @serving(tmp_path, handler, pool={"min_idle": 0})
    async def _(h: Harness) -> None:
        conn = await h.connect()
        reply = await conn.request("tools/call", {"user": USER, "name": "hello", "arguments": {"name": "x"}, "timeoutMs": 50})
        assert reply["result"]["status"] == "timeout"
        await asyncio.sleep(0.01)
        assert len(h.backend.destroyed) == 1
        assert repr(h.server.pool) == "<Pool [starting: 0, idle: 0, busy: 0, stopping: 0, waiting: 0]>"


def test_cancel_settled_keeps_the_sandbox_ignored_kills_it(tmp_path: Path) -> None:
    async def handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
        if request.arguments["name"] == "polite":
            await aborted.wait()
            return {"status": "error", "content": [{"type": "text", "text": "stopped"}], "isError": True}
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    @serving(tmp_path, handler, pool={"min_idle": 0}, calls={"cancel_grace_ms": 50})
    async def _(h: Harness) -> None:
        conn = await h.connect()
        for request_id, name in ((1, "polite"), (2, "stubborn")):
            conn.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                       "params": {"user": USER, "name": "hello", "arguments": {"name": name}}})
        await asyncio.sleep(0.05)
        for request_id in (1, 2):
            conn.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": request_id, "reason": "stop"}})
        replies = {r["id"]: r["result"] for r in [await conn.read(), await conn.read()]}
        assert replies[1]["status"] == "cancelled" and replies[1]["content"][0]["text"] == "stopped"
        assert replies[2]["status"] == "cancelled" and "killed" in replies[2]["content"][0]["text"]
        await asyncio.sleep(0.01)
        assert len(h.backend.destroyed) == 1
        assert repr(h.server.pool) == "<Pool [starting: 0, idle: 1, busy: 0, stopping: 0, waiting: 0]>"


def test_cancel_while_queued_answers_at_once(tmp_path: Path) -> None:
    @serving(tmp_path, ok_handler, pool={"min_idle": 0})
    async def _(h: Harness) -> None:
        h.backend.start_delay = 30
        conn = await h.connect()
        conn.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"user": USER, "name": "hello", "arguments": {"name": "x"}}})
        queued = "<Pool [starting: 1, idle: 0, busy: 0, stopping: 0, waiting: 1]>"
        await settled(lambda: repr(h.server.pool) == queued)  # a fixed 20-ms sleep was too short under load
        assert repr(h.server.pool) == queued
        conn.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}})
        reply = await conn.read()
        assert reply["result"]["status"] == "cancelled"
        assert "before it started" in reply["result"]["content"][0]["text"]
        assert repr(h.server.pool) == "<Pool [starting: 1, idle: 0, busy: 0, stopping: 0, waiting: 0]>"


def test_disconnect_cancels_calls_in_flight(tmp_path: Path) -> None:
    async def handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
        await aborted.wait()
        return {"status": "ok", "content": [], "isError": False}

    @serving(tmp_path, handler, pool={"min_idle": 0})
    async def _(h: Harness) -> None:
        conn = await h.connect()
        conn.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"user": USER, "name": "hello", "arguments": {"name": "x"}}})
        busy = "<Pool [starting: 0, idle: 0, busy: 1, stopping: 0, waiting: 0]>"
        await settled(lambda: repr(h.server.pool) == busy)  # a fixed sleep was too short on a loaded machine
        assert repr(h.server.pool) == busy
        conn.writer.close()
        await settled(lambda: bool(h.backend.sandboxes) and "idle: 1" in repr(h.server.pool))
        sandbox = next(iter(h.backend.sandboxes.values()))
        assert sandbox.cancel_reasons == ["client disconnected"]
        assert repr(h.server.pool) == "<Pool [starting: 0, idle: 1, busy: 0, stopping: 0, waiting: 0]>"


async def settled(done: Callable[[], bool], within_s: float = 5.0) -> None:
    """Wait until ``done()`` holds (the caller's assertion then says what did not, if it never does)."""
    for _ in range(int(within_s / 0.01)):
        if done():
            return
        await asyncio.sleep(0.01)


def test_crash_is_reported_and_replaced(tmp_path: Path) -> None:
    async def handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
        raise SandboxFailed("The tool ran out of memory: its sandbox is limited to 256m and was killed.")

    @serving(tmp_path, handler, pool={"min_idle": 1})
    async def _(h: Harness) -> None:
        conn = await h.connect()
        reply = await conn.request("tools/call", {"user": USER, "name": "hello", "arguments": {"name": "x"}})
        assert reply["result"]["status"] == "crashed" and "memory" in reply["result"]["content"][0]["text"]
        await asyncio.sleep(0.02)
        assert repr(h.server.pool) == "<Pool [starting: 0, idle: 1, busy: 0, stopping: 0, waiting: 0]>"


def test_framing_and_error_codes(tmp_path: Path) -> None:
    @serving(tmp_path, ok_handler, max_message_bytes=2048)
    async def _(h: Harness) -> None:
        conn = await h.connect()
        conn.send(b"{not json\n")
        assert (await conn.read())["error"]["code"] == -32700
        conn.send(b"\xff\xfe\n")
        assert (await conn.read())["error"]["code"] == -32700
        conn.send(b"[" * 100000 + b"\n")
        conn.send(b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n')
        first = await conn.read()
        assert first["error"]["code"] == -32600  # over the size limit, skipped
        assert (await conn.read()) == {"jsonrpc": "2.0", "id": 1, "result": {}}
        conn.send(b'[{"jsonrpc":"2.0","id":2,"method":"ping"}]\n')
        assert (await conn.read())["error"]["code"] == -32600
        conn.send(b'{"jsonrpc":"1.0","id":3,"method":"ping"}\n')
        assert (await conn.read()) ["error"]["code"] == -32600
        assert (await conn.request("nope", request_id=4))["error"]["code"] == -32601
        bad = await conn.request("tools/call", {"user": USER, "name": "hello", "arguments": {"name": 5, "x": 1}}, request_id=5)
        assert bad["error"]["code"] == -32602 and "x" in bad["error"]["message"]
        secret = await conn.request("tools/call", {"user": USER, "name": "hello",
                                                   "arguments": {"token": ["hunter22"]}}, request_id=6)
        assert secret["error"]["code"] == -32602 and "hunter22" not in json.dumps(secret)
        assert (await conn.request("ping", request_id=7))["result"] == {}


def test_reused_id_in_flight_is_refused(tmp_path: Path) -> None:
    async def handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
        await asyncio.sleep(0.1)
        return {"status": "ok", "content": [], "isError": False}

    @serving(tmp_path, handler)
    async def _(h: Harness) -> None:
        conn = await h.connect()
        params = {"user": USER, "name": "hello", "arguments": {"name": "x"}}
        for _ in range(2):
            conn.send({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": params})
        first, second = await conn.read(), await conn.read()
        assert first["error"]["code"] == -32602 and "already used" in first["error"]["message"]
        assert second["result"]["status"] == "ok"
        # The dispatcher owns ids in flight: a listing (answered later too) may not take one, a ping
        # (answered at once) may; an answered id is free again.
        conn.send({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": params})
        conn.send({"jsonrpc": "2.0", "id": 9, "method": "tools/list", "params": {"user": USER}})
        conn.send({"jsonrpc": "2.0", "id": 9, "method": "ping"})
        refused, pong, answered = await conn.read(), await conn.read(), await conn.read()
        assert refused["id"] == 9 and "already used by a request in flight" in refused["error"]["message"]
        assert pong == {"jsonrpc": "2.0", "id": 9, "result": {}} and answered["result"]["status"] == "ok"
        assert "tools" in (await conn.request("tools/list", {"user": USER}, request_id=9))["result"]


def test_backend_down_is_32002_and_recovers(tmp_path: Path) -> None:
    @serving(tmp_path, ok_handler)
    async def _(h: Harness) -> None:
        h.backend.unavailable()
        conn = await h.connect()
        params = {"user": USER, "name": "hello", "arguments": {"name": "x"}}
        assert (await conn.request("tools/call", params))["error"]["code"] == -32002
        h.backend.start_error = None
        assert (await conn.request("tools/call", params, request_id=2))["result"]["status"] == "ok"


def test_shutdown_refuses_new_calls(tmp_path: Path) -> None:
    async def main() -> None:
        hello_tree(tmp_path / "data")
        cfg = load_config(overrides={"data_path": tmp_path / "data", "socket": tmp_path / "s.sock",
                                     "seed_tools": None}, environ={})
        server = Server(cfg, FakeBackend(ok_handler))
        await server.startup()
        reader, writer = await asyncio.open_unix_connection(str(cfg.socket))
        conn = Conn(reader, writer)
        server.stopping = True
        reply = await conn.request("tools/call", {"user": USER, "name": "hello", "arguments": {"name": "x"}})
        assert reply["error"]["code"] == -32002 and "shutting down" in reply["error"]["message"]
        assert server.status()["calls"] == {"shutting_down": 1}  # counted like every other answer
        server.stopping = False
        await server.shutdown()
        assert not cfg.socket.exists()

    asyncio.run(main())


def flooding_handler(updates: int, size: int) -> Callable[..., Any]:
    async def handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
        for _ in range(updates):
            on_progress([{"type": "text", "text": "p" * size}])
            await asyncio.sleep(0)
        return {"status": "ok", "content": [], "isError": False}
    return handler


def test_progress_past_the_count_cap_crashes_the_call_and_replaces_the_sandbox(tmp_path: Path) -> None:
    @serving(tmp_path, flooding_handler(10, 1), calls={"max_progress_updates": 3}, pool={"min_idle": 0})
    async def _(h: Harness) -> None:
        conn = await h.connect()
        conn.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"user": USER, "name": "hello", "arguments": {"name": "x"}}})
        messages = [await conn.read() for _ in range(4)]
        assert [m.get("method") for m in messages[:3]] == ["notifications/progress"] * 3
        result = messages[3]["result"]
        assert result["status"] == "crashed" and "calls.max_progress_updates" in result["content"][0]["text"]
        await asyncio.sleep(0.01)
        assert len(h.backend.destroyed) == 1


def test_progress_past_the_byte_cap_crashes_the_call(tmp_path: Path) -> None:
    @serving(tmp_path, flooding_handler(5, 800), calls={"max_progress_bytes": 2048}, pool={"min_idle": 0})
    async def _(h: Harness) -> None:
        conn = await h.connect()
        reply = await conn.request("tools/call", {"user": USER, "name": "hello", "arguments": {"name": "x"}})
        assert reply["result"]["status"] == "crashed"
        assert "calls.max_progress_bytes" in reply["result"]["content"][0]["text"]


def test_a_client_that_stops_reading_pauses_its_calls_sandboxes(tmp_path: Path) -> None:
    async def handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
        await gates[0].wait()
        on_progress([{"type": "text", "text": "first"}])
        await gates[1].wait()
        on_progress([{"type": "text", "text": "second"}])
        return {"status": "ok", "content": [], "isError": False}

    gates: list[asyncio.Event] = []

    @serving(tmp_path, handler, pool={"min_idle": 0})
    async def _(h: Harness) -> None:
        gates[:] = [asyncio.Event(), asyncio.Event()]
        conn = await h.connect()
        await conn.request("ping")
        (connection,) = h.server.connections
        conn.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"user": USER, "name": "hello", "arguments": {"name": "x"}}})
        while not h.server.calls.in_flight:
            await asyncio.sleep(0.001)
        (call,) = h.server.calls.in_flight
        connection.pause_writing()  # as asyncio does past the write buffer's high-water mark
        gates[0].set()  # the call gets its sandbox while paused: paused at its first progress
        assert (await conn.read())["method"] == "notifications/progress"
        sandbox = call.sandbox
        assert sandbox.reading_paused
        connection.resume_writing()
        assert not sandbox.reading_paused
        connection.pause_writing()  # a running call's sandbox is paused at once
        assert sandbox.reading_paused
        gates[1].set()
        assert (await conn.read())["method"] == "notifications/progress"
        assert (await conn.read())["result"]["status"] == "ok"
        # The call ended while its client was paused: the sandbox goes back to the pool reading.
        assert not sandbox.reading_paused
        connection.resume_writing()


# --- hostile requests and hostile tool trees (issue 11) --------------------------------------

_DEEP = b"{DEEP}"  # replaced by nesting just under what the daemon's JSON parser takes
_BAD_REQUESTS = [
    # (line, code, id the answer carries)
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"user":["alice@example.com"]}}', -32602, 1),
    (b'{"jsonrpc":"2.0","id":2,"method":"tools/list","params":{"user":{"a":1}}}', -32602, 2),
    (b'{"jsonrpc":"2.0","id":3,"method":"tools/list","params":{"user":"alice@example.com\\n"}}', -32602, 3),
    (b'{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"user":"alice@example.com\\n","name":"hello",'
     b'"arguments":{"name":"x"}}}', -32602, 4),
    (b'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"user":"alice@example.com","name":"hello",'
     b'"arguments":{"name":' + b"9" * 400 + b'}}}', -32602, 5),
    (b'{"jsonrpc":"2.0","id":' + b"9" * 400 + b',"method":"ping"}', -32600, None),
    (b'{"jsonrpc":"2.0","id":6,"method":"ping","method":"tools/list"}', -32600, None),
    (b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"user":"alice@example.com","name":"hello",'
     b'"arguments":{"name":"x","name":"y"}}}', -32600, None),
    (b'{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"user":"alice@example.com","name":"hello",'
     b'"arguments":{"name":' + _DEEP + b'}}}', -32602, 8),
    (b'{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"user":"alice@example.com","name":"hello",'
     b'"arguments":{"name":"x"},"_meta":{"progressToken":' + _DEEP + b'}}}', -32602, 9),
    (b'{"jsonrpc":"2.0","id":10,"method":"tools/call","params":{"user":"alice@example.com","name":"hello",'
     b'"arguments":{"name":"x"},"_meta":[]}}', -32602, 10),
]


def test_every_bad_request_shape_gets_its_code(tmp_path: Path) -> None:
    @serving(tmp_path, ok_handler, max_message_bytes=1 << 20)
    async def _(h: Harness) -> None:
        conn = await h.connect()
        depth = 1000
        while True:  # the parser's limit depends on the daemon's own call depth: find it
            conn.send(b'{"jsonrpc":"2.0","id":0,"method":"ping","params":' + b"[" * depth + b"]" * depth + b"}\n")
            if "result" in await conn.read():
                break
            depth -= 1
        deep = b"[" * (depth - 4) + b"]" * (depth - 4)  # as deep, under four more objects
        for line, code, request_id in _BAD_REQUESTS:
            conn.send(line.replace(_DEEP, deep) + b"\n")
            reply = await conn.read()
            assert (reply["id"], reply["error"]["code"]) == (request_id, code), (line[:120], reply)
            assert reply["error"]["message"]
        assert (await conn.request("ping", request_id="alive"))["result"] == {}


def test_a_user_in_other_case_is_the_same_user(tmp_path: Path) -> None:
    @serving(tmp_path, ok_handler, pool={"min_idle": 0})
    async def _(h: Harness) -> None:
        conn = await h.connect()
        reply = await conn.request("tools/call", {"user": "Alice@Example.COM", "name": "hello", "arguments": {"name": "x"}})
        assert reply["result"]["status"] == "ok"
        assert {sandbox.user for sandbox in h.backend.sandboxes.values()} == {USER}


def _block_scans_of(monkeypatch: Any, user: str) -> Any:
    """Make parsing the user's TOOL.md files wait for the returned event (at most 3 s)."""
    import threading

    from sandboxd.tools import discovery

    release = threading.Event()
    real = discovery._parse

    def parse(manifest_path: Path, root: Path) -> Any:
        if user in str(manifest_path):
            release.wait(3)
        return real(manifest_path, root)

    monkeypatch.setattr(discovery, "_parse", parse)
    return release


def test_a_slow_scan_never_holds_up_pings_or_other_users(tmp_path: Path, monkeypatch: Any) -> None:
    mallory = "mallory@example.com"
    tool = tmp_path / "data" / mallory / "tools" / "slow"
    tool.mkdir(parents=True)
    (tool / "TOOL.md").write_text("---\nname: slow\ndescription: Slow.\nversion: 1\n---\n# Slow\n")
    (tool / "index.ts").write_text("export async function execute() {}\n")
    release = _block_scans_of(monkeypatch, mallory)

    @serving(tmp_path, ok_handler)
    async def _(h: Harness) -> None:
        conn = await h.connect()
        conn.send({"jsonrpc": "2.0", "id": "slow", "method": "tools/list", "params": {"user": mallory}})
        conn.send({"jsonrpc": "2.0", "id": "ping", "method": "ping"})
        conn.send({"jsonrpc": "2.0", "id": "list", "method": "tools/list", "params": {"user": USER}})
        conn.send({"jsonrpc": "2.0", "id": "call", "method": "tools/call",
                   "params": {"user": USER, "name": "hello", "arguments": {"name": "x"}}})
        try:
            # Scanned on the event loop, mallory's listing would come first, 3 s late.
            first = [(await conn.read())["id"] for _ in range(3)]
        finally:
            release.set()
        assert sorted(first) == ["call", "list", "ping"]
        slow = await conn.read()
        assert slow["id"] == "slow" and [t["name"] for t in slow["result"]["tools"]] == ["hello", "slow"]


def test_a_tool_added_after_a_listing_is_callable_at_once(tmp_path: Path) -> None:
    @serving(tmp_path, ok_handler)
    async def _(h: Harness) -> None:
        conn = await h.connect()
        assert [t["name"] for t in (await conn.request("tools/list", {"user": USER}))["result"]["tools"]] == ["hello"]
        tool = tmp_path / "data" / USER / "tools" / "fresh"
        tool.mkdir(parents=True)
        (tool / "TOOL.md").write_text("---\nname: fresh\ndescription: New.\nversion: 1\n"
                                      "inputs:\n  name:\n    type: string\n    description: Who.\n---\n# Fresh\n")
        (tool / "index.ts").write_text("export async function execute() {}\n")
        reply = await conn.request("tools/call", {"user": USER, "name": "fresh", "arguments": {"name": "x"}}, request_id=2)
        assert reply["result"]["status"] == "ok"
        unknown = await conn.request("tools/call", {"user": USER, "name": "nope", "arguments": {}}, request_id=3)
        assert unknown["error"]["code"] == -32602 and "known: fresh, hello" in unknown["error"]["message"]


def test_warm_calls_scan_nothing(tmp_path: Path, monkeypatch: Any) -> None:
    from sandboxd.tools import discovery, freshness

    monkeypatch.setattr(freshness, "RACY_WINDOW_NS", 0)
    monkeypatch.setattr(freshness, "RACY_WINDOW_FINE_NS", 0)
    scans: list[Path] = []
    real = discovery.ToolCatalog._scan

    def counting(self: Any, root: Path, *args: Any, **kwargs: Any) -> Any:
        scans.append(root)
        return real(self, root, *args, **kwargs)

    monkeypatch.setattr(discovery.ToolCatalog, "_scan", counting)

    @serving(tmp_path, ok_handler)
    async def _(h: Harness) -> None:
        conn = await h.connect()
        await conn.request("tools/call", {"user": USER, "name": "hello", "arguments": {"name": "x"}})
        scans.clear()
        for request_id in range(2, 52):
            reply = await conn.request("tools/call", {"user": USER, "name": "hello", "arguments": {"name": "x"}},
                                       request_id=request_id)
            assert reply["result"]["status"] == "ok"
        assert scans == []


def test_a_call_waiting_for_a_tools_scan_can_be_cancelled_and_keeps_its_id(tmp_path: Path, monkeypatch: Any) -> None:
    # A call whose tools changed waits for a rescan in a worker; meanwhile it is already in
    # flight: a cancel reaches it (it answers cancelled, the tool never runs), its id is taken.
    mallory = "mallory@example.com"
    tool = tmp_path / "data" / mallory / "tools" / "slow"
    tool.mkdir(parents=True)
    (tool / "TOOL.md").write_text("---\nname: slow\ndescription: Slow.\nversion: 1\ninputs:\n  name:\n    type: string\n"
                                  "    description: Who.\n---\n# Slow\n")
    (tool / "index.ts").write_text("export async function execute() {}\n")
    release = _block_scans_of(monkeypatch, mallory)

    @serving(tmp_path, ok_handler)
    async def _(h: Harness) -> None:
        conn = await h.connect()
        try:
            conn.send({"jsonrpc": "2.0", "id": "c", "method": "tools/call",
                       "params": {"user": mallory, "name": "slow", "arguments": {"name": "x"}}})
            conn.send({"jsonrpc": "2.0", "id": "c", "method": "tools/call",
                       "params": {"user": mallory, "name": "slow", "arguments": {"name": "y"}}})
            reused = await conn.read()
            assert reused["id"] == "c" and reused["error"]["code"] == -32602 and "already used" in reused["error"]["message"]
            assert (await conn.request("sandbox/status", request_id="s"))["result"]["callsInFlight"] == 1
            conn.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "c", "reason": "stop"}})
            await conn.request("ping", request_id="p")  # the cancel was read before the scan ends
        finally:
            release.set()
        answer = await conn.read()
        assert answer["id"] == "c" and answer["result"]["status"] == "cancelled", answer
        assert "cancelled before it started (stop)" in answer["result"]["content"][0]["text"]
        assert h.backend.starts == 0  # the tool never ran
        assert (await conn.request("sandbox/status", request_id="t"))["result"]["callsInFlight"] == 0


def test_the_turn_budget_holds_a_pipelined_flood_to_a_turn_at_a_time(tmp_path: Path) -> None:
    """While one connection's pipelined flood is worked through, another's line is handled within
    a turn or two of it, not after all of it; the flood loses nothing."""
    order: list[str] = []

    @serving(tmp_path)
    async def test(h: Harness) -> None:
        real = Dispatcher.handle_line

        def spy(self: Dispatcher, line: bytes) -> None:
            order.append("b" if b'"b"' in line else "f")
            real(self, line)

        Dispatcher.handle_line = spy  # type: ignore[method-assign]
        try:
            flood, bystander = await h.connect(), await h.connect()
            flood.send(b"".join(b'{"jsonrpc":"2.0","id":%d,"method":"ping"}\n' % i for i in range(10 * LINES_PER_TURN)))
            bystander.send({"jsonrpc": "2.0", "id": "b", "method": "ping"})
            await asyncio.gather(flood.writer.drain(), bystander.writer.drain())
            assert (await bystander.read())["id"] == "b"
            assert [(await flood.read())["id"] for _ in range(10 * LINES_PER_TURN)] == list(range(10 * LINES_PER_TURN))
        finally:
            Dispatcher.handle_line = real  # type: ignore[method-assign]
        assert order.index("b") <= 2 * LINES_PER_TURN, order.index("b")

    test  # noqa: B018


def test_a_refused_peer_is_answered_after_the_door_delay(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(PeerPolicy, "refusal", lambda self, sock: "uid 1 may not use this sandboxd.")

    @serving(tmp_path, allowed_uids=[12345])
    async def test(h: Harness) -> None:
        started = asyncio.get_running_loop().time()
        conn = await h.connect()
        reply = await conn.read()
        assert reply["error"]["code"] == -32003 and "may not use" in reply["error"]["message"]
        assert asyncio.get_running_loop().time() - started >= RefusedPeers.DELAY_S * 0.9
        assert await conn.reader.read() == b""  # then the door
        # Past MAX_HELD waiting at once, the next is answered at once (each held one is an fd).
        h.server.refused_peers.held = RefusedPeers.MAX_HELD
        started = asyncio.get_running_loop().time()
        conn = await h.connect()
        assert (await conn.read())["error"]["code"] == -32003
        assert asyncio.get_running_loop().time() - started < RefusedPeers.DELAY_S
        h.server.refused_peers.held = 0

    test  # noqa: B018
