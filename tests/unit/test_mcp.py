"""The pure parts of `sandboxd mcp`: conversions, the stdio line decoder, the HTTP guard and its settings."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sandboxd.client import RpcError
from sandboxd.errors import ConfigError
from sandboxd.mcp.convert import call_result, content_blocks, is_tool_error, mcp_tool, progress_message
from sandboxd.mcp.http import MIN_TOKEN_CHARS, Guard, authorized, own_origins, parse_address, token_from
from sandboxd.mcp.limits import FD_RESERVE, HttpLimits, connection_cap
from sandboxd.mcp.stdio import InFlight, decode
from sandboxd.mcp.strict import duplicate_key_error

TOKEN = b"k" * MIN_TOKEN_CHARS


def test_a_tool_reads_as_its_tool_md_says() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    tool = mcp_tool({"name": "hello", "label": "Hello", "description": "Says hello.", "inputSchema": schema,
                     "documentation": "\n# Hello Tool\nCall it with a name.\n"})
    assert (tool.name, tool.title, tool.input_schema) == ("hello", "Hello", schema)
    assert tool.description == "Says hello.\n\n# Hello Tool\nCall it with a name."
    bare = mcp_tool({"name": "x", "label": "", "description": "Only this.", "inputSchema": schema, "documentation": ""})
    assert (bare.title, bare.description) == (None, "Only this.")


def test_results_keep_content_and_is_error_and_say_the_status() -> None:
    ok = call_result({"content": [{"type": "text", "text": "hi"}, {"type": "image", "data": "aGk=", "mimeType": "image/png"}],
                      "isError": False, "status": "ok", "durationMs": 3})
    dumped = ok.model_dump(by_alias=True, mode="json", exclude_none=True)
    assert dumped["content"] == [{"type": "text", "text": "hi"}, {"type": "image", "data": "aGk=", "mimeType": "image/png"}]
    assert dumped["isError"] is False and dumped["_meta"] == {"sandboxd/status": "ok", "sandboxd/durationMs": 3}
    # isError as the tool returned it, even with status ok
    assert call_result({"content": [], "isError": True, "status": "error", "durationMs": 1}).is_error
    assert call_result({"content": [], "status": "timeout"}).is_error


def test_a_content_block_mcp_cannot_carry_is_named_not_fatal() -> None:
    blocks = content_blocks([{"type": "text", "text": "kept"}, {"type": "hologram", "beam": 1}, "a string", {"type": "image"}])
    texts = [block.text for block in blocks]
    assert texts[0] == "kept"
    assert "hologram content block" in texts[1] and "str content block" in texts[2] and "image content block" in texts[3]
    assert content_blocks("not a list") == []


def test_which_daemon_errors_are_the_models_to_act_on() -> None:
    violations = RpcError(-32602, "invalid arguments", [{"path": "/name", "message": "required"}])
    assert is_tool_error(violations)
    assert not is_tool_error(RpcError(-32602, "unknown tool 'x' for u@example.com"))
    assert not is_tool_error(RpcError(-32602, "forbidden env", {"names": ["X"]}))
    assert is_tool_error(RpcError(-32001, "overloaded")) and is_tool_error(RpcError(-32002, "Docker is down"))
    assert is_tool_error(RpcError(-32004, "over quota"))  # the model can tell the user to free space
    assert not is_tool_error(RpcError(-32603, "internal"))


def test_progress_is_the_count_and_the_text_of_the_update() -> None:
    assert progress_message({"progressToken": 1, "progress": 2, "content": [{"type": "text", "text": "a"},
                                                                           {"type": "image", "data": ""},
                                                                           {"type": "text", "text": "b"}]}) == (2.0, "a\nb")
    assert progress_message({"progress": True, "content": "junk"}) == (0.0, None)


@pytest.mark.parametrize("line, code, request_id", [
    (b"nope", -32700, None),
    (b"\xff", -32700, None),
    (b"[" * 50_000, -32700, None),
    (b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]', -32600, None),
    (b'{"jsonrpc":"2.0","id":5,"method":["x"]}', -32600, 5),
    (b'{"jsonrpc":"2.0","id":true,"method":"ping"}', -32600, None),
    (b'{"jsonrpc":"2.0","id":null,"method":"ping"}', -32600, None),
    (b'{"jsonrpc":"2.0","id":{},"method":"ping"}', -32600, None),
])
def test_a_line_that_is_not_a_message_gets_its_error(line: bytes, code: int, request_id: Any) -> None:
    answer = decode(line)
    assert isinstance(answer, dict) and (answer["error"]["code"], answer["id"]) == (code, request_id)


def test_messages_decode_as_the_sdk_reads_them() -> None:
    assert type(decode(b'{"jsonrpc":"2.0","id":"a","method":"ping"}')).__name__ == "JSONRPCRequest"
    note = decode(b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"id"}}')
    assert type(note).__name__ == "JSONRPCNotification"


def test_reading_waits_while_the_limit_of_requests_is_unanswered() -> None:
    async def scenario() -> None:
        gate = InFlight(2)
        gate.add(1)
        gate.add("1")  # a string id is another id
        waiting = asyncio.ensure_future(gate.room())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        gate.done(1)
        await asyncio.wait_for(waiting, 1)
        gate.done("never seen")  # an unknown id changes nothing
        gate.add(2)
        assert not asyncio.ensure_future(gate.room()).done()

    asyncio.run(scenario())


def test_the_listen_address_is_loopback_unless_allowed() -> None:
    assert parse_address("127.0.0.1:8765") == ("127.0.0.1", 8765)
    assert parse_address("localhost:1") == ("127.0.0.1", 1)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    for bad, says in (("8765", "not HOST:PORT"), ("127.0.0.1:0", "not a port"), ("127.0.0.1:99999", "not a port"),
                      ("example.com:80", "not an IP address"), ("0.0.0.0:80", "mcp_http_remote"),
                      ("[::]:80", "not a loopback address"), ("192.168.1.4:80", "TLS proxy")):
        with pytest.raises(ConfigError, match=says):
            parse_address(bad)
    assert parse_address("0.0.0.0:80", ["mcp_http_remote"]) == ("0.0.0.0", 80)


def test_the_token_is_required_long_and_compared_whole() -> None:
    with pytest.raises(ConfigError, match="is not set"):
        token_from({})
    with pytest.raises(ConfigError, match="fewer than"):
        token_from({"SANDBOXD_MCP_TOKEN": "short"})
    assert token_from({"SANDBOXD_MCP_TOKEN": f"  {TOKEN.decode()}\n"}) == TOKEN
    assert authorized(f"Bearer {TOKEN.decode()}", TOKEN) and authorized(f"bearer  {TOKEN.decode()}", TOKEN)
    for header in (None, "", "Bearer", f"Basic {TOKEN.decode()}", f"Bearer {TOKEN.decode()}x",
                   f"Bearer {TOKEN.decode()[:-1]}", f"Bearer {TOKEN.decode()[:-1]}é", TOKEN.decode()):
        assert not authorized(header, TOKEN), header


def test_the_origins_served_are_the_servers_own_and_those_named() -> None:
    origins, hosts = own_origins("127.0.0.1", 8765, ["https://mcp.example.com"])
    assert origins == {"http://127.0.0.1:8765", "http://localhost:8765", "http://[::1]:8765", "https://mcp.example.com"}
    assert hosts == {"127.0.0.1:8765", "localhost:8765", "[::1]:8765", "mcp.example.com"}
    for bad in ("mcp.example.com", "ftp://x", "https://x/path"):
        with pytest.raises(ConfigError, match="is not an origin"):
            own_origins("127.0.0.1", 1, [bad])


def guarded(headers: list[tuple[bytes, bytes]], scope_type: str = "http", body: bytes = b"",
            status: int = 200) -> tuple[list[dict[str, Any]], bool]:
    reached = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append((await receive())["body"])  # the body read by the guard, replayed
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"inner"})

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    chunks = [body[:5], body[5:]]

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}

    guard = Guard(app, TOKEN, {"http://127.0.0.1:1"}, max_body=1 << 20, limits=HttpLimits(max_sessions=3))
    asyncio.run(guard({"type": scope_type, "headers": headers, "method": "POST", "path": "/mcp"}, receive, send))
    return sent, bool(reached)


def test_the_guard_lets_through_only_the_token_and_the_servers_origins() -> None:
    auth = (b"authorization", b"Bearer " + TOKEN)
    assert guarded([auth])[1] and guarded([auth])[0][0]["status"] == 200
    assert guarded([auth, (b"origin", b"http://127.0.0.1:1")])[1]
    for headers, status in (([], 401), ([(b"authorization", b"Bearer nope")], 401),
                            ([auth, (b"origin", b"http://evil.example")], 403)):
        sent, reached = guarded(headers)
        assert not reached and sent[0]["status"] == status
        assert json.loads(sent[1]["body"])["error"]["code"] == -32600
        # Without the token the connection is closed after the answer: it holds no slot for another try.
        assert ((b"connection", b"close") in sent[0]["headers"]) is (status == 401)
    assert guarded([auth], "websocket") == ([], False)


def test_the_guard_refuses_a_body_with_a_key_twice_and_replays_the_others() -> None:
    auth = (b"authorization", b"Bearer " + TOKEN)
    good = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"hello"}}'
    sent, reached = guarded([auth], body=good)
    assert reached and sent[1]["body"] == b"inner"
    sent, reached = guarded([auth], body=b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","name":"b"}}')
    assert not reached and sent[0]["status"] == 400
    answer = json.loads(sent[1]["body"])
    assert answer["id"] == 1 and 'the key "name" appears twice' in answer["error"]["message"]


def test_the_sdks_session_cap_is_said_with_its_flags() -> None:
    sent, _ = guarded([(b"authorization", b"Bearer " + TOKEN)], status=503)
    assert sent[0]["status"] == 503 and len(sent) == 2
    assert "holds 3 sessions (--max-sessions)" in json.loads(sent[1]["body"])["error"]["message"]


@pytest.mark.parametrize("line, request_id", [
    (b'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"safe","name":"evil"}}', 3),
    (b'{"jsonrpc":"2.0","id":3,"id":4,"method":"ping"}', None),
    (b'{"jsonrpc":"2.0","jsonrpc":"2.0","id":"x","method":"ping"}', "x"),
])
def test_a_key_twice_anywhere_is_refused_on_stdio(line: bytes, request_id: Any) -> None:
    answer = decode(line)
    assert isinstance(answer, dict) and (answer["error"]["code"], answer["id"]) == (-32600, request_id)
    assert "appears twice" in answer["error"]["message"]
    assert duplicate_key_error(b'{"a": {"b": 1}, "c": {"b": 2}}') is None  # the same key in two objects is fine


def test_http_limits_are_checked_and_held_to_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    for bad in ({"max_connections": 2}, {"head_timeout_s": 0}, {"max_sessions": 0}, {"session_idle_s": float("nan")}):
        with pytest.raises(ConfigError, match="out of range"):
            HttpLimits(**bad)
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (300, 300))
    assert connection_cap(1000) == 300 - FD_RESERVE and connection_cap(100) == 100
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (64, 64))
    with pytest.raises(ConfigError, match=r"open-file limit \(64\)"):
        connection_cap(100)


class _Conn:
    """A stand-in for a connection: whether it is serving a request, and whether it was closed."""

    def __init__(self, mid_request: bool = False) -> None:
        self.mid_request, self.aborted = mid_request, False
        self.transport = self

    def abort(self) -> None:
        self.aborted = True


def test_a_newcomer_past_the_cap_closes_the_oldest_idle_connection_never_one_serving() -> None:
    from sandboxd.mcp.connections import Admission

    async def scenario() -> None:
        admission = Admission(3, 5.0, TOKEN)
        serving, idle_old, idle_new = _Conn(mid_request=True), _Conn(), _Conn()
        for conn in (serving, idle_old, idle_new):
            assert admission.admit(conn)  # type: ignore[arg-type]
        newcomer = _Conn()
        assert admission.admit(newcomer)  # type: ignore[arg-type]
        assert idle_old.aborted and not serving.aborted and not idle_new.aborted
        assert list(admission.strangers) == [serving, idle_new, newcomer]
        idle_new.mid_request = newcomer.mid_request = True
        assert not admission.admit(_Conn())  # type: ignore[arg-type]  # every one is serving: refused
        assert (admission.evicted, admission.refused) == (1, 1)

    asyncio.run(scenario())


def test_a_connection_that_carried_the_token_is_closed_only_when_no_idle_stranger_is_left() -> None:
    from sandboxd.mcp.connections import Admission

    async def scenario() -> None:
        admission = Admission(3, 5.0, TOKEN)
        holder, wrong, silent = _Conn(), _Conn(), _Conn()
        for conn in (holder, wrong, silent):  # the token holder's connection is the oldest
            assert admission.admit(conn)  # type: ignore[arg-type]
        admission.heard(holder, b"Bearer " + TOKEN)  # type: ignore[arg-type]
        admission.heard(wrong, b"Bearer " + TOKEN[:-1] + b"x")  # type: ignore[arg-type]
        assert list(admission.vouched) == [holder] and list(admission.strangers) == [wrong, silent]
        first, second = _Conn(), _Conn()
        assert admission.admit(first) and admission.admit(second)  # type: ignore[arg-type]
        assert wrong.aborted and silent.aborted and not holder.aborted  # strangers first, oldest first
        first.mid_request = second.mid_request = True
        assert admission.admit(_Conn())  # type: ignore[arg-type]  # no idle stranger left: the holder's, last
        assert holder.aborted and (admission.evicted, admission.evicted_vouched) == (2, 1)

    asyncio.run(scenario())


def test_token_holders_are_closed_idle_longest_first() -> None:
    from sandboxd.mcp.connections import Admission

    async def scenario() -> None:
        admission = Admission(2, 5.0, TOKEN)
        early, late = _Conn(), _Conn()
        for conn in (early, late):
            assert admission.admit(conn)  # type: ignore[arg-type]
            admission.heard(conn, b"Bearer " + TOKEN)  # type: ignore[arg-type]
        admission.heard(early, b"Bearer " + TOKEN)  # type: ignore[arg-type]  # a later request on the older one
        assert admission.admit(_Conn())  # type: ignore[arg-type]
        assert late.aborted and not early.aborted
    asyncio.run(scenario())
