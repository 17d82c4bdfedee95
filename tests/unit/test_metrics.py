"""Metrics and the per-call log event, on a live server with the fake backend."""

from __future__ import annotations

import asyncio
import socket
import io
import json
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sandboxd import __version__
from sandboxd.config import load_config
from sandboxd.egress.contract import EgressCall
from sandboxd.errors import ConfigError
from sandboxd.logging import configure_logging, lines_dropped, set_log_budget
from sandboxd.rules.secrets import StandIns
from sandboxd.sandbox.backend import CallRequest
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.server.server import Server
from tests.unit.test_server import USER, hello_tree

SECRET_ENV = "env-secret-value-1234"
SECRET_ARG = "argument-secret-5678"


async def handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
    name = request.arguments["name"]
    if name == "fail":
        return {"status": "ok", "content": [{"type": "text", "text": "no"}], "isError": True}
    if name == "slow":
        await asyncio.sleep(30)
    return {"status": "ok", "content": [{"type": "text", "text": f"Hello, {name}!"}], "isError": False}


def run_server(tmp_path: Path, test: Callable[[Server], Any], *, orphans: int = 0, **settings: Any) -> None:
    async def main(short_dir: Path) -> None:
        hello_tree(tmp_path / "data")
        config = load_config(environ={}, overrides={
            "data_path": tmp_path / "data", "socket": short_dir / "s.sock",
            "seed_tools": None, "backend": "fake"} | settings)
        backend = FakeBackend(handler)
        backend.orphans = [f"orphan-{i}" for i in range(orphans)]
        server = Server(config, backend)
        await server.startup()
        try:
            await test(server)
        finally:
            await server.shutdown()

    with tempfile.TemporaryDirectory(prefix="sbd-") as short_dir:  # a socket's path is at most 108 bytes
        asyncio.run(main(Path(short_dir)))


async def call(server: Server, name: str, **extra: Any) -> dict[str, Any]:
    reader, writer = await asyncio.open_unix_connection(str(server.config.socket))
    params = {"user": USER, "name": "hello", "arguments": {"name": name}} | extra
    writer.write(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}).encode() + b"\n")
    reply = json.loads(await asyncio.wait_for(reader.readline(), 10))
    writer.close()
    return reply


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) → value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def http_get(open_connection: Any, target: str = "/metrics", method: str = "GET",
                   accept: str = "") -> tuple[str, dict[str, str], bytes]:
    reader, writer = await open_connection
    headers = f"Accept: {accept}\r\n" if accept else ""
    writer.write(f"{method} {target} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    return status_line, dict(line.split(": ", 1) for line in lines), body


def test_calls_sandboxes_and_orphans_are_counted(tmp_path: Path) -> None:
    async def test(server: Server) -> None:
        assert (await call(server, "World"))["result"]["status"] == "ok"
        assert (await call(server, "fail"))["result"]["status"] == "error"
        assert (await call(server, "slow", timeoutMs=20))["result"]["status"] == "timeout"
        await asyncio.sleep(0.05)  # the killed sandbox's replacement starts
        idle = next(iter(server.backend.sandboxes.values()))
        idle.die()  # an idle sandbox crashes by itself
        await asyncio.sleep(0.05)
        values = samples(server.metrics.render()[0].decode())
        assert values[("sandboxd_calls_total", (("status", "ok"), ("tool", "hello")))] == 1
        assert values[("sandboxd_calls_total", (("status", "error"), ("tool", "hello")))] == 1
        assert values[("sandboxd_calls_total", (("status", "timeout"), ("tool", "hello")))] == 1
        assert values[("sandboxd_call_duration_seconds_count", (("tool", "hello"),))] == 3
        assert values[("sandboxd_queue_wait_seconds_count", ())] == 3
        assert values[("sandboxd_sandbox_kills_total", ())] == 1
        assert values[("sandboxd_sandbox_crashes_total", ())] == 1
        assert values[("sandboxd_sandbox_starts_total", ())] == server.backend.starts == 3
        assert values[("sandboxd_orphans_reaped_total", ())] == 2
        assert values[("sandboxd_sandboxes", (("state", "idle"),))] == 1
        assert values[("sandboxd_sandboxes", (("state", "busy"),))] == 0
        assert values[("sandboxd_calls_in_flight", ())] == 0
        assert values[("sandboxd_build_info", (("backend", "fake"), ("version", __version__)))] == 1
        assert server.status()["pool"]["counters"]["killed"] == 1

    run_server(tmp_path, test, orphans=2, pool={"min_idle": 1, "max_per_user": 1})


def test_rejected_calls_are_counted_with_their_reason(tmp_path: Path) -> None:
    async def test(server: Server) -> None:
        # The first call holds the user's one sandbox until its deadline; a loaded machine may take a
        # while to get it there, so the second call is sent once it holds, not after a fixed sleep.
        first = asyncio.get_running_loop().create_task(call(server, "slow", timeoutMs=2000))
        for _ in range(500):
            if samples(server.metrics.render()[0].decode())[("sandboxd_pool_users", (("state", "holding"),))]:
                break
            await asyncio.sleep(0.01)
        reply = await call(server, "World")
        assert reply["error"]["code"] == -32001
        assert reply["error"]["data"]["reason"] == "user_limit"
        values = samples(server.metrics.render()[0].decode())  # while the first call still holds its sandbox
        assert values[("sandboxd_pool_users", (("state", "holding"),))] == 1
        assert values[("sandboxd_pool_users", (("state", "waiting"),))] == 0
        assert values[("sandboxd_pool_user_most", (("state", "holding"),))] == 1
        await first
        values = samples(server.metrics.render()[0].decode())
        assert values[("sandboxd_calls_total", (("status", "overloaded"), ("tool", "hello")))] == 1
        assert values[("sandboxd_pool_refusals_total", (("reason", "user_limit"),))] == 1
        assert values[("sandboxd_pool_refusals_total", (("reason", "pool_full"),))] == 0
        assert values[("sandboxd_pool_users", (("state", "holding"),))] == 0  # idle now
        # Users are never a label of the pool's or the calls' series; the disk's are the documented exception
        # (a row per user with folders on disk, there once the quota's first measurement ran).
        assert not [name for name, labels in values if "user" in dict(labels) and not name.startswith("sandboxd_user_disk_")]
        assert server.status()["calls"]["overloaded"] == 1
        assert server.status()["pool"]["refusals"]["user_limit"] == 1

    run_server(tmp_path, test, pool={"min_idle": 0, "max_per_user": 1, "acquire_timeout_ms": 50})


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_endpoint_serves_metrics_and_nothing_else(tmp_path: Path, short_dir: Path, transport: str) -> None:
    metrics_socket = short_dir / "metrics.sock"
    listen = "127.0.0.1:0" if transport == "tcp" else str(metrics_socket)

    async def test(server: Server) -> None:
        await call(server, "World")
        if transport == "tcp":
            host, port = server.metrics._listener.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
            connect: Callable[[], Any] = lambda: asyncio.open_connection(host, port)
        else:
            assert oct(metrics_socket.stat().st_mode & 0o777) == "0o660"
            connect = lambda: asyncio.open_unix_connection(str(metrics_socket))
        status, headers, body = await http_get(connect())
        assert status == "HTTP/1.1 200 OK" and headers["Content-Type"].startswith("text/plain")
        assert int(headers["Content-Length"]) == len(body)
        assert samples(body.decode())[("sandboxd_calls_total", (("status", "ok"), ("tool", "hello")))] == 1
        status, headers, body = await http_get(connect(), accept="application/openmetrics-text; version=1.0.0")
        assert headers["Content-Type"].startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
        assert (await http_get(connect(), "/other"))[0] == "HTTP/1.1 404 Not Found"
        assert (await http_get(connect(), method="POST"))[0] == "HTTP/1.1 405 Method Not Allowed"

    run_server(tmp_path, test, metrics={"listen": listen})
    assert not metrics_socket.exists()  # removed at shutdown


@pytest.mark.parametrize("listen", ["0.0.0.0:9464", "192.168.1.5:9464", "[::]:9464", "example.com:80", "metrics.sock", "127.0.0.1:x"])
def test_metrics_refuse_anything_but_loopback_or_a_socket_path(listen: str) -> None:
    with pytest.raises(ConfigError, match="metrics.listen"):
        load_config(environ={"SANDBOXD_METRICS_LISTEN": listen})


def test_one_call_event_per_call_without_secrets(tmp_path: Path) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)

    async def test(server: Server) -> None:
        reply = await call(server, "World", env={"OFFICER_APIFY_TOKEN": SECRET_ENV}, toolCallId="call_x")
        assert reply["result"]["status"] == "ok"
        reply = await call(server, "fail", arguments={"name": "fail", "token": SECRET_ARG})
        assert reply["result"]["status"] == "error"

    run_server(tmp_path, test)
    text = stream.getvalue()
    assert SECRET_ENV not in text and SECRET_ARG not in text
    events = [json.loads(line) for line in text.splitlines()]
    calls = [e for e in events if e["event"] == "call"]
    assert len(calls) == 2
    assert {k: calls[0][k] for k in ("user", "tool", "tool_call_id", "status")} == {
        "user": USER, "tool": "hello", "tool_call_id": "call_x", "status": "ok"}
    assert calls[1]["status"] == "error"
    for event in calls:
        assert isinstance(event["duration_ms"], int) and isinstance(event["queue_ms"], int)
        assert event["sandbox"].startswith("fake-")
        assert "arguments" not in event and "env" not in event


def test_call_events_past_the_users_log_budget_are_dropped_and_counted_but_every_call_is_in_the_metrics(
        tmp_path: Path) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    set_log_budget(rate=0.001, burst=2)
    dropped_before = lines_dropped().get("user", 0)

    async def test(server: Server) -> None:
        for _ in range(5):
            assert (await call(server, "World"))["result"]["status"] == "ok"
        await asyncio.sleep(0.05)  # each call is recorded just after its answer
        values = samples(server.metrics.render()[0].decode())
        assert values[("sandboxd_calls_total", (("status", "ok"), ("tool", "hello")))] == 5
        assert values[("sandboxd_call_duration_seconds_count", (("tool", "hello"),))] == 5

    try:
        run_server(tmp_path, test)
    finally:
        set_log_budget(rate=10, burst=100)
    calls = [e for e in map(json.loads, stream.getvalue().splitlines()) if e["event"] == "call"]
    assert len(calls) == 2 and all(e["user"] == USER and e["status"] == "ok" and "budget" not in e for e in calls)
    assert lines_dropped()["user"] - dropped_before == 3


def test_egress_decisions_are_counted_by_decision_and_reason(tmp_path: Path) -> None:
    async def test(server: Server) -> None:
        ours, theirs = socket.socketpair()
        session = server.egress.session(USER, "s1", lambda: EgressCall("hello", frozenset(), StandIns()))
        handled = asyncio.ensure_future(session.handle(theirs))
        reader, writer = await asyncio.open_connection(sock=ours)
        writer.write(b"CONNECT 10.0.0.5:443 HTTP/1.1\r\n\r\n")
        assert b"403 Forbidden" in await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await handled
        values = samples(server.metrics.render()[0].decode())
        assert values[("sandboxd_egress_requests_total",
                       (("decision", "refused"), ("reason", "private address")))] == 1

    run_server(tmp_path, test)


def test_secret_substitutions_are_counted_by_name(tmp_path: Path) -> None:
    async def test(server: Server) -> None:
        server.egress.secret_uses.update(["OFFICER_APIFY_TOKEN", "OFFICER_APIFY_TOKEN"])  # as two requests would
        values = samples(server.metrics.render()[0].decode())
        assert values[("sandboxd_egress_secret_uses_total", (("name", "OFFICER_APIFY_TOKEN"),))] == 2

    run_server(tmp_path, test)
