"""sd_notify and socket activation against real sockets standing in for systemd."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from sandboxd.client import Client
from sandboxd.config import load_config
from sandboxd.errors import ConfigError
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.server.server import serve
from sandboxd.service import systemd
from sandboxd.service.systemd import Notifier, listen_socket, supervise, watchdog_interval

REPO = Path(__file__).resolve().parents[2]


def parse(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().split("\n"))


@pytest.fixture
def notify_path() -> Iterator[tuple[str, socket.socket]]:
    """A filesystem NOTIFY_SOCKET: (the value systemd would set, the receiving socket)."""
    directory = tempfile.mkdtemp(prefix="sbd-notify-")
    path = os.path.join(directory, "notify")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(5)
    yield path, receiver
    receiver.close()
    os.unlink(path)
    os.rmdir(directory)


@pytest.fixture
def notify_abstract() -> Iterator[tuple[str, socket.socket]]:
    """An abstract-namespace NOTIFY_SOCKET (`@name`), as systemd itself uses."""
    name = f"sandboxd-test-{uuid.uuid4().hex}"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind("\0" + name)
    receiver.settimeout(5)
    yield "@" + name, receiver
    receiver.close()


@pytest.mark.parametrize("kind", ["notify_path", "notify_abstract"])
def test_notifications_reach_the_socket(kind: str, request: pytest.FixtureRequest) -> None:
    address, receiver = request.getfixturevalue(kind)
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": address})
    assert notifier.enabled
    assert notifier.ready("serving on /run/x.sock\nsecond line")
    assert parse(receiver.recv(4096)) == {"READY": "1", "STATUS": "serving on /run/x.sock second line"}
    assert notifier.reloading()
    reloading = parse(receiver.recv(4096))
    assert reloading["RELOADING"] == "1"
    now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert 0 <= now_usec - int(reloading["MONOTONIC_USEC"]) < 5_000_000
    assert notifier.watchdog() and parse(receiver.recv(4096)) == {"WATCHDOG": "1"}
    assert notifier.stopping("stopping") and parse(receiver.recv(4096)) == {"STOPPING": "1", "STATUS": "stopping"}
    notifier.close()


def test_without_systemd_nothing_is_sent() -> None:
    notifier = Notifier.from_environ({})
    assert not notifier.enabled
    assert notifier.ready("x") is False


def test_a_missing_notify_socket_is_reported_not_raised(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "nobody-listens"))
    assert notifier.ready("x") is False
    assert notifier.watchdog() is False
    assert Notifier("relative/path").enabled is False


def test_watchdog_interval_is_half_and_only_ours() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({}) is None


def test_supervise_feeds_the_watchdog_and_sends_status_only_when_it_changes(notify_path: Any) -> None:
    address, receiver = notify_path
    receiver.setblocking(False)
    states = iter(["a", "a", "a", "b"] + ["b"] * 1000)
    messages: list[dict[str, str]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = loop.create_task(supervise(Notifier(address), lambda: next(states), 0.01))
        while len(messages) < 6:
            messages.append(parse(await asyncio.wait_for(loop.sock_recv(receiver, 4096), 5)))
        task.cancel()

    asyncio.run(main())
    assert all(m["WATCHDOG"] == "1" for m in messages)
    assert [m["STATUS"] for m in messages if "STATUS" in m] == ["a", "b"]


def test_listen_socket_ignores_other_processes_and_cleans_the_environment() -> None:
    environ = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x", "OTHER": "y"}
    assert listen_socket(environ) is None
    assert environ == {"OTHER": "y"}
    assert listen_socket({}) is None


@pytest.mark.parametrize("count, fragment", [("2", "exactly one"), ("x", "not a number")])
def test_listen_socket_rejects_bad_counts(count: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        listen_socket({"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": count})


def run_with_fd3(sock: socket.socket, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child whose fd 3 is ``sock`` and whose LISTEN_* say so, as systemd would."""
    prelude = "import os\nos.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1')\n"
    fd = sock.fileno()
    return subprocess.run(
        # bash moves the socket to fd 3 just before exec, as systemd hands it over (dash cannot name fds > 9).
        ["/bin/bash", "-c", f'exec "$@" {systemd.SD_LISTEN_FDS_START}<&{fd} {fd}<&-', "sh",
         sys.executable, "-c", prelude + textwrap.dedent(code)],
        pass_fds=(fd,), cwd=REPO, capture_output=True, text=True, timeout=60,
    )


def test_listen_socket_takes_the_passed_listening_socket(short_dir: Path) -> None:
    path = str(short_dir / "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(8)
        proc = run_with_fd3(listener, """
            from sandboxd.service.systemd import listen_socket
            sock = listen_socket()
            print(sock.getsockname(), sock.fileno(), os.get_inheritable(3), sock.getblocking(), "LISTEN_FDS" in os.environ)
        """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [path, "3", "False", "False", "False"]


@pytest.mark.parametrize("kind, fragment", [("dgram", "not a unix stream socket"), ("unlistening", "not listening")])
def test_listen_socket_rejects_the_wrong_kind_of_socket(kind: str, fragment: str) -> None:
    sock_type = socket.SOCK_DGRAM if kind == "dgram" else socket.SOCK_STREAM
    with socket.socket(socket.AF_UNIX, sock_type) as sock:
        proc = run_with_fd3(sock, """
            from sandboxd.errors import ConfigError
            from sandboxd.service.systemd import listen_socket
            try:
                listen_socket()
            except ConfigError as exc:
                print(exc.message)
        """)
    assert fragment in proc.stdout, proc.stdout + proc.stderr


def test_serve_reports_ready_only_when_listening_then_reload_and_stopping(tmp_path: Path, short_dir: Path, notify_abstract: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    address, receiver = notify_abstract
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # a ping every 10 ms
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    socket_path = short_dir / "s.sock"
    settings = {"data_path": tmp_path / "data", "socket": socket_path, "seed_tools": None, "backend": "fake"}
    config = load_config(overrides=settings, environ={})
    reloaded = load_config(overrides=settings | {"pool": {"max_per_user": 7}}, environ={})
    receiver.setblocking(False)

    async def next_message(key: str) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        while True:
            message = parse(await asyncio.wait_for(loop.sock_recv(receiver, 4096), 10))
            if key in message:
                return message

    async def main() -> None:
        server_task = asyncio.get_running_loop().create_task(
            serve(config, FakeBackend(), reload_config=lambda: reloaded))
        starting = await next_message("STATUS")
        assert "starting" in starting["STATUS"] and "READY" not in starting
        ready = await next_message("READY")
        assert ready["STATUS"].startswith(f"serving on {socket_path}")
        # READY=1 means the socket answers now, not soon.
        assert await asyncio.to_thread(lambda: Client(socket_path, timeout=5).request("ping")) == {}
        assert (await next_message("WATCHDOG"))["WATCHDOG"] == "1"
        os.kill(os.getpid(), signal.SIGHUP)
        assert (await next_message("RELOADING"))["RELOADING"] == "1"
        assert (await next_message("READY"))["READY"] == "1"
        status = await asyncio.to_thread(lambda: Client(socket_path, timeout=5).request("sandbox/status"))
        assert status["limits"]["maxPerUser"] == 7
        os.kill(os.getpid(), signal.SIGTERM)
        stopping = await next_message("STOPPING")
        assert stopping["STATUS"].startswith("stopping")
        await asyncio.wait_for(server_task, 10)

    asyncio.run(main())
    assert not socket_path.exists()
