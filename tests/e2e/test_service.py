"""Running as a service, end to end: metrics, status, peer checks, reload, socket activation."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Any, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sandboxd import __version__
from sandboxd.client import Client
from tests.as_user import PING, exchange_as
from tests.e2e.conftest import REPO, Daemon

pytestmark = pytest.mark.docker

A = "alice@example.com"
PONG = {"jsonrpc": "2.0", "id": 1, "result": {}}


def events(daemon: Daemon, name: str) -> list[dict[str, Any]]:
    found = []
    for line in daemon.log_path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == name:
            found.append(event)
    return found


def wait_for(condition: Callable[[], Any], what: str, daemon: Daemon, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s:\n{daemon.log()}")


def status(daemon: Daemon) -> dict[str, Any]:
    with daemon.client(timeout=10) as client:
        return client.request("sandbox/status")


def sandboxd_cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandboxd", *args, "--socket", str(daemon.socket)],
                          capture_output=True, text=True, cwd=REPO, env=daemon.env, timeout=60)


def test_metrics_status_and_call_log_after_real_calls(make_daemon: Any) -> None:
    daemon = make_daemon('metrics:\n  listen: "127.0.0.1:0"\npool:\n  min_idle: 1\n')
    with daemon.client() as client:
        assert client.call_tool(A, "hello", {"name": "World"})["status"] == "ok"
        assert client.call_tool(A, "thrower", {})["status"] == "error"
        assert client.call_tool(A, "exiter", {"code": 3})["status"] == "crashed"
        assert client.call_tool(A, "hello", {"name": "again"})["status"] == "ok"

    host, port = events(daemon, "metrics_listening")[0]["address"].rsplit(":", 1)
    assert host == "127.0.0.1"
    connection = http.client.HTTPConnection(host, int(port), timeout=10)  # no proxy: loopback only
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    assert response.status == 200
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(response.read().decode()) for s in family.samples}
    connection.close()
    assert values[("sandboxd_calls_total", (("status", "ok"), ("tool", "hello")))] == 2
    assert values[("sandboxd_calls_total", (("status", "error"), ("tool", "thrower")))] == 1
    assert values[("sandboxd_calls_total", (("status", "crashed"), ("tool", "exiter")))] == 1
    assert values[("sandboxd_call_duration_seconds_count", (("tool", "hello"),))] == 2
    assert values[("sandboxd_queue_wait_seconds_count", ())] == 4
    assert values[("sandboxd_sandbox_crashes_total", ())] == 1
    assert values[("sandboxd_sandbox_kills_total", ())] == 0
    assert values[("sandboxd_sandbox_starts_total", ())] >= 2  # the first, and the crashed one's replacement
    assert values[("sandboxd_orphans_reaped_total", ())] == 0
    assert values[("sandboxd_sandboxes", (("state", "busy"),))] == 0
    assert values[("sandboxd_build_info", (("backend", "docker"), ("version", __version__)))] == 1
    assert values[("process_open_fds", ())] > 0

    readable = sandboxd_cli(daemon, "status")
    assert readable.returncode == 0, readable.stderr
    assert "backend docker over socket" in readable.stdout and f"  {A}: " in readable.stdout
    assert "calls: crashed 1, error 1, ok 2" in readable.stdout
    assert "1 crashed" in readable.stdout and "limits: 4 sandboxes per user" in readable.stdout
    raw = sandboxd_cli(daemon, "status", "--json")
    assert json.loads(raw.stdout)["calls"] == {"ok": 2, "error": 1, "crashed": 1}

    calls = events(daemon, "call")
    assert [(e["tool"], e["status"]) for e in calls] == [("hello", "ok"), ("thrower", "error"), ("exiter", "crashed"), ("hello", "ok")]
    for event in calls:
        assert event["user"] == A and isinstance(event["duration_ms"], int) and len(event["sandbox"]) == 12
        assert "arguments" not in event and "World" not in json.dumps(event)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as other uids")
def test_peer_check_and_reload_on_sighup(make_daemon: Any) -> None:
    daemon = make_daemon('socket_mode: "0666"\nallowed_uids: [12345]\npool:\n  max_per_user: 2\n  min_idle: 0\n')
    daemon.socket.parent.chmod(0o755)  # let the other uids reach the socket; the peer check decides
    path = str(daemon.socket)

    refused = exchange_as(path, 65534)
    assert len(refused) == 1 and refused[0]["id"] is None and refused[0]["error"]["code"] == -32003
    assert "uid 65534" in refused[0]["error"]["message"]
    assert exchange_as(path, 12345) == [PONG]
    refusal = wait_for(lambda: events(daemon, "peer_refused"), "peer_refused log", daemon)[0]
    assert (refusal["uid"], refusal["gid"]) == (65534, 65534) and refusal["pid"] > 0

    daemon.config_path.write_text(
        'socket_mode: "0600"\nallowed_uids: [12345, nobody]\npool:\n  max_per_user: 3\n  min_idle: 0\n'
        "calls:\n  default_timeout_ms: 4321\n")
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: status(daemon)["limits"]["maxPerUser"] == 3, "reload", daemon)
    assert status(daemon)["limits"]["defaultTimeoutMs"] == 4321
    assert exchange_as(path, 65534) == [PONG]  # now allowed
    reloaded = events(daemon, "config_reloaded")[-1]
    assert sorted(reloaded["applied"]) == ["allowed_uids", "calls.default_timeout_ms", "pool.max_per_user"]
    assert reloaded["needs_restart"] == ["socket_mode"]
    assert daemon.socket.stat().st_mode & 0o777 == 0o666  # a restart would apply it, a reload does not
    with daemon.client() as client:
        assert client.call_tool(A, "hello", {"name": "after reload"})["status"] == "ok"

    daemon.config_path.write_text("pool:\n  max_per_user: 0\n")
    daemon.proc.send_signal(signal.SIGHUP)
    failure = wait_for(lambda: events(daemon, "config_reload_failed"), "config_reload_failed", daemon)[0]
    assert "pool.max_per_user" in failure["error"]
    assert status(daemon)["limits"]["maxPerUser"] == 3 and daemon.proc.poll() is None


def start_activated(daemon: Daemon, listener: socket.socket, notify_name: str) -> None:
    """Start the real daemon as systemd would for sandboxd.socket: fd 3, LISTEN_FDS=1, LISTEN_PID=its pid."""
    fd = listener.fileno()
    log = open(daemon.log_path, "ab")
    daemon.proc = subprocess.Popen(
        # bash's $$ is the pid the daemon will have after exec; dash cannot redirect fds above 9.
        ["/bin/bash", "-c", f'LISTEN_PID=$$ LISTEN_FDS=1 exec "$@" 3<&{fd} {fd}<&-', "sh",
         sys.executable, "-m", "sandboxd", "serve", "--config", str(daemon.config_path),
         "--data-path", str(daemon.data), "--socket", str(daemon.socket), "--seed-tools", str(REPO / "seed" / "tools")],
        pass_fds=(fd,), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        env={**daemon.env, "NOTIFY_SOCKET": "@" + notify_name},
    )
    log.close()


def next_notification(receiver: socket.socket, key: str, daemon: Daemon) -> dict[str, str]:
    while True:
        try:
            datagram = receiver.recv(4096)
        except TimeoutError:
            raise AssertionError(f"no {key}=1 from the daemon:\n{daemon.log()}") from None
        message = dict(line.split("=", 1) for line in datagram.decode().split("\n"))
        if key in message:
            return message


def test_socket_activation_with_readiness_and_restart(make_daemon: Any) -> None:
    daemon = make_daemon(start=False)
    # What systemd does for sandboxd.socket: bind and listen before the daemon exists.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(daemon.socket))
    daemon.socket.chmod(0o660)
    listener.listen(16)
    notify_name = f"sandboxd-e2e-{uuid.uuid4().hex}"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind("\0" + notify_name)
    receiver.settimeout(60)
    try:
        # A client that arrives before the daemon: its request waits in the socket's queue.
        early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        early.settimeout(60)
        early.connect(str(daemon.socket))
        early.sendall(PING)

        start_activated(daemon, listener, notify_name)
        ready = next_notification(receiver, "READY", daemon)
        assert ready["STATUS"].startswith(f"serving on {daemon.socket}")
        assert json.loads(early.makefile("rb").readline()) == PONG
        early.close()
        listening = events(daemon, "listening")[-1]
        assert listening["activated"] is True and listening["socket"] == str(daemon.socket)
        assert listening["event_loop"] == "uvloop"  # config event_loop: auto
        assert not events(daemon, "socket_mismatch")

        assert daemon.stop() == 0
        assert next_notification(receiver, "STOPPING", daemon)["STOPPING"] == "1"
        assert daemon.socket.exists()  # systemd's socket: the daemon must not remove it

        # A restart serves the same socket; a client connecting in between is not refused.
        between = Client(daemon.socket, timeout=60)
        between.send({"jsonrpc": "2.0", "id": 1, "method": "ping"})
        start_activated(daemon, listener, notify_name)
        next_notification(receiver, "READY", daemon)
        assert between.read_message() == PONG
        between.close()
    finally:
        receiver.close()
        listener.close()
