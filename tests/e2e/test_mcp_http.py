"""`sandboxd mcp --http`: the MCP SDK's client over streamable HTTP, the token, the Origin, the address."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any, Iterator

import anyio
import httpx2
import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from tests.e2e.conftest import write_tool
from tests.e2e.mcp_session import (ERAS, TOKEN, USER, HttpServer, abort_marker_tool, free_port, mcp_command,
                                   server_env, text_of)

pytestmark = pytest.mark.docker

FAST = "pool:\n  min_idle: 1\n  shutdown_grace_s: 0.5\n"
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                         "clientInfo": {"name": "probe", "version": "1"}}}
ACCEPT = "application/json, text/event-stream"


@pytest.fixture
def served(make_daemon: Any) -> Iterator[tuple[Any, HttpServer]]:
    daemon = make_daemon(FAST)
    server = HttpServer(daemon, "--allow-origin", "https://mcp.example.com")
    yield daemon, server
    server.stop()


@pytest.mark.parametrize("era", ERAS)
def test_list_call_progress_cancel_and_list_changed_over_http(served: tuple[Any, HttpServer], era: str) -> None:
    daemon, server = served
    user_dir = abort_marker_tool(daemon)

    async def scenario() -> None:
        announced = anyio.Event()

        async def on_message(message: Any) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                announced.set()

        seen: list[float] = []

        async def progress(value: float, total: float | None, message: str | None) -> None:
            seen.append(value)

        async with server.session(era, message_handler=on_message) as client:
            assert {"hello", "abort_marker"} <= {tool.name for tool in (await client.list_tools()).tools}
            assert text_of(await client.call_tool("hello", {"name": "Web"})) == "Hello, Web!"
            assert (await client.call_tool("thrower", {})).is_error
            with pytest.raises(MCPError, match="unknown tool 'no_such_tool'"):
                await client.call_tool("no_such_tool", {})
            assert text_of(await client.call_tool("progress", {"steps": 2}, progress_callback=progress)) == "did 2 steps"
            assert seen == [1.0, 2.0]

            started = time.monotonic()
            with anyio.move_on_after(1.5):
                await client.call_tool("abort_marker", {"tag": f"http-{era}"})
            marker = user_dir / f"aborted-http-{era}.txt"
            while not marker.exists() and time.monotonic() - started < 10:
                await anyio.sleep(0.05)
            assert marker.read_text().endswith("cancelled by the MCP client")

            tools_dir = daemon.user_dir(USER) / "tools"
            source = "export async function execute() { return { content: [] }; }\n"
            if era == "legacy":  # on the session's GET stream
                write_tool(tools_dir, "fresh", source)
                with anyio.fail_after(10):
                    await announced.wait()
            else:
                async with client.listen(tools_list_changed=True) as subscription:
                    write_tool(tools_dir, "fresh", source)
                    with anyio.fail_after(10):
                        async for _event in subscription:
                            break
            assert "fresh" in {tool.name for tool in (await client.list_tools()).tools}

    anyio.run(scenario)


def post(url: str, headers: dict[str, str], body: Any = INITIALIZE) -> httpx2.Response:
    return httpx2.post(url, headers={"Accept": ACCEPT, "Content-Type": "application/json", **headers},
                       content=json.dumps(body), timeout=10)


def test_every_request_needs_the_bearer_token(served: tuple[Any, HttpServer]) -> None:
    _, server = served
    for headers in ({}, {"Authorization": "Bearer wrong-" + TOKEN[6:]}, {"Authorization": TOKEN},
                    {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
        refused = post(server.url, headers)
        assert refused.status_code == 401, (headers, refused.text)
        assert refused.headers["www-authenticate"].startswith("Bearer")
        assert "SANDBOXD_MCP_TOKEN" in refused.json()["error"]["message"]
    assert httpx2.get(server.url, timeout=10).status_code == 401  # the GET stream too
    assert httpx2.delete(server.url, timeout=10).status_code == 401
    accepted = post(server.url, {"Authorization": f"Bearer {TOKEN}"})
    assert accepted.status_code == 200, accepted.text

    async def wrong_token() -> None:
        with pytest.raises(BaseException) as failed:
            async with server.session("legacy", token="not-the-token"):
                pass
        assert "Authorization: Bearer" in " ".join(messages(failed.value))  # what the SDK's client reports

    anyio.run(wrong_token)


def messages(exc: BaseException) -> list[str]:
    """The messages of an exception and of those grouped inside it."""
    if isinstance(exc, BaseExceptionGroup):
        return [text for inner in exc.exceptions for text in messages(inner)]
    return [str(exc)]


def test_a_foreign_origin_is_refused_and_the_servers_own_are_served(served: tuple[Any, HttpServer]) -> None:
    _, server = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{server.port + 1}", "https://mcp.example.com.evil"):
        refused = post(server.url, {**auth, "Origin": origin})
        assert refused.status_code == 403, (origin, refused.text)
        assert "is not one this server serves" in refused.json()["error"]["message"]
    for origin in (f"http://127.0.0.1:{server.port}", f"http://localhost:{server.port}", "https://mcp.example.com"):
        assert post(server.url, {**auth, "Origin": origin}).status_code == 200, origin
    # DNS rebinding: a page at a name that resolves to 127.0.0.1 sends its own Host.
    rebound = post(server.url, {**auth, "Host": f"attacker.example:{server.port}"})
    assert rebound.status_code == 421, rebound.text


def test_a_non_loopback_address_is_refused_unless_allow_unsafe_names_it(make_daemon: Any) -> None:
    daemon = make_daemon(FAST, start=False)
    env = server_env({"SANDBOXD_MCP_TOKEN": TOKEN})
    for address in (f"0.0.0.0:{free_port()}", f"[::]:{free_port()}", f"10.1.2.3:{free_port()}"):
        run = subprocess.run(mcp_command(daemon, "--http", address), capture_output=True, env=env, timeout=30)
        assert run.returncode == 2, run
        message = run.stderr.decode()
        assert "is not a loopback address" in message and "allow_unsafe: [mcp_http_remote]" in message, message
    short = subprocess.run(mcp_command(daemon, "--http", f"127.0.0.1:{free_port()}"), capture_output=True,
                           env=server_env({"SANDBOXD_MCP_TOKEN": "short"}), timeout=30)
    assert short.returncode == 2 and "SANDBOXD_MCP_TOKEN" in short.stderr.decode()
    missing = subprocess.run(mcp_command(daemon, "--http", f"127.0.0.1:{free_port()}"), capture_output=True,
                             env=server_env(), timeout=30)
    assert missing.returncode == 2 and "is not set" in missing.stderr.decode()


def test_a_body_over_max_message_bytes_is_refused_unread(make_daemon: Any) -> None:
    daemon = make_daemon(FAST + "max_message_bytes: 65536\n")
    server = HttpServer(daemon)
    try:
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "hello", "arguments": {"name": "x" * 100_000}}}
        refused = post(server.url, {"Authorization": f"Bearer {TOKEN}"}, call)
        assert refused.status_code == 413, refused.text
        assert post(server.url, {"Authorization": f"Bearer {TOKEN}"}).status_code == 200  # still serving
    finally:
        server.stop()


def test_a_key_given_twice_is_refused_never_run(make_daemon: Any) -> None:
    from tests.e2e.test_mcp_hostile import DUPLICATE_NAME, evil_tool

    daemon = make_daemon(FAST)
    ran = evil_tool(daemon)
    server = HttpServer(daemon)
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        opened = post(server.url, auth)
        assert opened.status_code == 200, opened.text
        session = {**auth, "Mcp-Session-Id": opened.headers["mcp-session-id"], "Mcp-Protocol-Version": "2025-11-25"}
        assert post(server.url, session, {"jsonrpc": "2.0", "method": "notifications/initialized"}).status_code == 202
        refused = httpx2.post(server.url, headers={"Accept": ACCEPT, "Content-Type": "application/json", **session},
                              content=DUPLICATE_NAME, timeout=30)
        assert refused.status_code == 400, refused.text
        error = refused.json()
        assert error["id"] == 5 and error["error"]["code"] == -32600, error
        assert 'the key "name" appears twice' in error["error"]["message"], error
        assert not ran.exists(), "the tool named by the second key ran"
        call = {"jsonrpc": "2.0", "id": 6, "method": "tools/call", "params": {"name": "hello", "arguments": {"name": "x"}}}
        served = post(server.url, session, call)  # the session goes on
        assert served.status_code == 200 and "Hello, x!" in served.text, served.text
    finally:
        server.stop()
