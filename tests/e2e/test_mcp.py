"""`sandboxd mcp` over stdio, driven by the official MCP SDK's client, against a real daemon and Docker.

Each test runs in both protocol eras the SDK serves: the initialize handshake (2025-11-25)
and 2026-07-28's per-request envelope.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import anyio
import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from tests.e2e.conftest import write_tool
from tests.e2e.mcp_session import ERAS, USER, abort_marker_tool, mcp_command, server_env, stdio_session, text_of

pytestmark = pytest.mark.docker

FAST = "pool:\n  min_idle: 1\n  shutdown_grace_s: 0.5\n"


@pytest.mark.parametrize("era", ERAS)
def test_the_catalogue_is_the_users_tools_with_their_documentation(make_daemon: Any, era: str) -> None:
    daemon = make_daemon(FAST)
    write_tool(daemon.user_dir(USER) / "tools", "mine", "export async function execute() { return { content: [] }; }\n",
               inputs="  x:\n    type: number\n    description: A number.\n")
    with daemon.client() as probe:
        expected = {tool["name"]: tool for tool in probe.request("tools/list", {"user": USER})["tools"]}

    async def scenario() -> None:
        async with stdio_session(daemon, era) as client:
            tools = {tool.name: tool for tool in (await client.list_tools()).tools}
            assert set(tools) == set(expected)
            hello = tools["hello"]
            assert hello.title == "Hello"
            assert hello.description.startswith(expected["hello"]["description"])
            assert expected["hello"]["documentation"].strip() in hello.description  # the TOOL.md body
            assert hello.input_schema == expected["hello"]["inputSchema"]
            assert tools["mine"].input_schema["properties"]["x"]["type"] == "number"

    anyio.run(scenario)


@pytest.mark.parametrize("era", ERAS)
def test_calls_run_in_the_users_sandbox_and_errors_are_results(make_daemon: Any, era: str) -> None:
    daemon = make_daemon(FAST)

    async def scenario() -> None:
        async with stdio_session(daemon, era) as client:
            ok = await client.call_tool("hello", {"name": "World"})
            assert (text_of(ok), ok.is_error, ok.meta["sandboxd/status"]) == ("Hello, World!", False, "ok")

            thrown = await client.call_tool("thrower", {})
            assert thrown.is_error and thrown.meta["sandboxd/status"] == "error"
            assert "the database is on fire" in text_of(thrown)

            crashed = await client.call_tool("exiter", {"code": 3})
            assert crashed.is_error and crashed.meta["sandboxd/status"] == "crashed"

            # Arguments the schema refuses: the model can correct them, so it is a result.
            refused = await client.call_tool("hello", {"nmae": "typo"})
            assert refused.is_error and "name" in text_of(refused)

            with pytest.raises(MCPError) as unknown:
                await client.call_tool("no_such_tool", {})
            assert unknown.value.error.code == -32602 and "unknown tool 'no_such_tool'" in unknown.value.error.message

    anyio.run(scenario)


@pytest.mark.parametrize("era", ERAS)
def test_on_update_is_progress_when_the_client_asks_for_it(make_daemon: Any, era: str) -> None:
    daemon = make_daemon(FAST)

    async def scenario() -> None:
        seen: list[tuple[float, str | None]] = []

        async def progress(value: float, total: float | None, message: str | None) -> None:
            seen.append((value, message))

        async with stdio_session(daemon, era) as client:
            result = await client.call_tool("progress", {"steps": 3}, progress_callback=progress)
            assert text_of(result) == "did 3 steps"
            assert seen == [(1.0, "step 1"), (2.0, "step 2"), (3.0, "step 3")]
            quiet = await client.call_tool("progress", {"steps": 2})  # no token: no progress, same result
            assert text_of(quiet) == "did 2 steps"

    anyio.run(scenario)


@pytest.mark.parametrize("era", ERAS)
def test_cancelling_a_call_fires_the_tools_abort_signal_in_its_sandbox(make_daemon: Any, era: str) -> None:
    daemon = make_daemon(FAST)
    user_dir = abort_marker_tool(daemon)

    async def scenario() -> None:
        async with stdio_session(daemon, era) as client:
            await client.call_tool("hello", {"name": "warm"})
            started = time.monotonic()
            with anyio.move_on_after(1.5):  # the SDK's client sends notifications/cancelled
                await client.call_tool("abort_marker", {"tag": era})
            marker = user_dir / f"aborted-{era}.txt"
            while not marker.exists() and time.monotonic() - started < 10:
                await anyio.sleep(0.05)
            assert marker.read_text().endswith("cancelled by the MCP client")
            assert time.monotonic() - started < 5  # at the cancel, not at the tool's 30 s
            # The session goes on: the sandbox settled within the grace and serves the next call.
            assert text_of(await client.call_tool("hello", {"name": "again"})) == "Hello, again!"

    anyio.run(scenario)
    calls = daemon.events("call", tool="abort_marker")
    assert [c["status"] for c in calls] == ["cancelled"], daemon.log()
    with daemon.client() as probe:
        assert probe.request("sandbox/status")["pool"]["counters"]["killed"] == 0  # it stopped by itself


@pytest.mark.parametrize("era", ERAS)
def test_a_tool_added_to_the_users_folder_is_announced_as_list_changed(make_daemon: Any, era: str) -> None:
    daemon = make_daemon(FAST)
    tools_dir = daemon.user_dir(USER) / "tools"

    async def scenario() -> None:
        announced = anyio.Event()

        async def on_message(message: Any) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                announced.set()

        async with stdio_session(daemon, era, message_handler=on_message) as client:
            assert "fresh" not in {tool.name for tool in (await client.list_tools()).tools}
            if era == "legacy":
                write_tool(tools_dir, "fresh", "export async function execute() { return { content: [] }; }\n")
                with anyio.fail_after(10):
                    await announced.wait()
            else:
                async with client.listen(tools_list_changed=True) as subscription:
                    write_tool(tools_dir, "fresh", "export async function execute() { return { content: [] }; }\n")
                    with anyio.fail_after(10):
                        async for event in subscription:
                            assert type(event).__name__ == "ToolsListChanged"
                            break
            assert "fresh" in {tool.name for tool in (await client.list_tools()).tools}

    anyio.run(scenario)


@pytest.mark.parametrize("era", ERAS)
def test_the_allowed_env_of_the_servers_environment_reaches_the_tool(make_daemon: Any, era: str) -> None:
    daemon = make_daemon(FAST + "calls:\n  allowed_env: [OFFICER_APIFY_TOKEN, PI_SEARXNG_URL]\n")
    env = {"OFFICER_APIFY_TOKEN": "apify-secret-17", "OFFICER_RESOURCES": "not allowed by this daemon"}

    async def scenario() -> None:
        async with stdio_session(daemon, era, env=env) as client:
            seen = json.loads(text_of(await client.call_tool("env_probe", {})))
            assert seen["OFFICER_APIFY_TOKEN"] == "apify-secret-17"
            assert seen.get("OFFICER_RESOURCES") is None and seen.get("PI_SEARXNG_URL") is None

    anyio.run(scenario)
    assert "apify-secret-17" not in daemon.log_path.read_text()


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25"])
def test_each_handshake_version_is_served_as_asked(make_daemon: Any, version: str) -> None:
    daemon = make_daemon(FAST)
    host = subprocess.Popen(mcp_command(daemon), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=server_env())
    lines = [{"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}},
             {"jsonrpc": "2.0", "method": "notifications/initialized"},
             {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "hello", "arguments": {"name": version}}}]
    assert host.stdin is not None and host.stdout is not None
    host.stdin.write(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    host.stdin.flush()  # and kept open: the end of stdin ends the session, and its calls
    answers: dict[int, Any] = {}
    while 2 not in answers:
        answer = json.loads(host.stdout.readline())
        if "id" in answer:  # not a notification (a list_changed from the tools watch, say)
            answers[answer["id"]] = answer
    host.stdin.close()
    assert host.wait(20) == 0
    assert answers[1]["result"]["protocolVersion"] == version
    assert answers[1]["result"]["capabilities"]["tools"]["listChanged"] is True
    assert answers[2]["result"]["content"] == [{"type": "text", "text": f"Hello, {version}!"}]


def test_the_calls_deadline_is_passed_as_timeout_ms(make_daemon: Any) -> None:
    daemon = make_daemon(FAST)

    async def scenario() -> None:
        async with stdio_session(daemon, "legacy", "--timeout", "1") as client:
            result = await client.call_tool("sleeper", {"ms": 10000})
            assert result.is_error and result.meta["sandboxd/status"] == "timeout"
            assert result.meta["sandboxd/durationMs"] < 5000

    anyio.run(scenario)


def test_a_daemon_that_is_down_is_a_clear_error_at_start(make_daemon: Any) -> None:
    daemon = make_daemon(FAST, start=False)
    started = time.monotonic()
    run = subprocess.run(mcp_command(daemon), input=b"", capture_output=True, env=server_env(), timeout=30)
    assert run.returncode == 2
    assert f"no sandboxd is listening on {daemon.socket}" in run.stderr.decode(), run.stderr
    assert time.monotonic() - started < 15

    async def scenario() -> None:
        with pytest.raises(Exception):  # the SDK's client sees the process end, not a hang
            with anyio.fail_after(20):
                async with stdio_session(daemon, "legacy"):
                    pass

    anyio.run(scenario)


def test_a_uid_the_daemon_refuses_gets_the_daemons_reason_at_start(make_daemon: Any) -> None:
    """The socket's peer check applies to `sandboxd mcp` as to any client (needs root, to be someone else)."""
    daemon = make_daemon(FAST + "socket_mode: '0666'\nallowed_uids: [12345]\n")
    daemon.socket.parent.chmod(0o755)
    from sandboxd.cli.main import build_parser
    from sandboxd.cli.mcp_cmds import run_mcp
    from sandboxd.config import load_config
    import sandboxd.mcp.serve  # noqa: F401 - imported before the child drops to a uid that cannot read the venv

    args = build_parser().parse_args(["mcp", "--user", USER, "--socket", str(daemon.socket)])
    config = load_config(daemon.config_path, overrides={"socket": daemon.socket}, environ={})
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: `sandboxd mcp` as nobody
        code = 3
        try:
            os.close(read_end)
            os.dup2(write_end, 2)
            sys.stderr = os.fdopen(2, "w", buffering=1)  # pytest's capture is not fd 2
            os.dup2(os.open(os.devnull, os.O_RDWR), 0)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = run_mcp(args, config)
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as stderr:
        said = stderr.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 2, said
    assert "refused" in said and "allowed_uids" in said, said


@pytest.mark.parametrize("era", ERAS)
def test_a_daemon_restarted_mid_session_is_reconnected_at_the_next_call(make_daemon: Any, era: str) -> None:
    daemon = make_daemon(FAST)

    async def scenario() -> None:
        announced = anyio.Event()

        async def on_message(message: Any) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                announced.set()

        async with stdio_session(daemon, era, message_handler=on_message) as client:
            assert text_of(await client.call_tool("hello", {"name": "before"})) == "Hello, before!"
            await anyio.to_thread.run_sync(daemon.stop)
            down = await client.call_tool("hello", {"name": "meanwhile"})
            assert down.is_error and "no sandboxd is listening" in text_of(down)
            await anyio.to_thread.run_sync(daemon.start)
            assert text_of(await client.call_tool("hello", {"name": "after"})) == "Hello, after!"
            assert "hello" in {tool.name for tool in (await client.list_tools()).tools}
            if era == "legacy":  # the tools may have changed while the daemon was away: list again
                with anyio.fail_after(5):
                    await announced.wait()

    anyio.run(scenario)
