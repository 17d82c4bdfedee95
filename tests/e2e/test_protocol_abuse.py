"""Abusing the wire protocol of a real daemon: random bytes, huge lines, deep nesting,
invalid UTF-8, thousands of connections opened and dropped, reused ids, cancel storms.

After each: no crash, every line the daemon wrote is JSON, no internal errors, the
connection (and a fresh one) still works, and nothing is left in flight. The
property-based version of the same runs on the fake backend
(tests/unit/test_protocol_fuzz.py); this one proves it against the real process.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections import Counter
from typing import Any, Iterator

import pytest

from tests.e2e.conftest import Daemon
from tests.e2e.hostile_harness import BYSTANDER_A, assert_pool_recovers, call, module_daemon, wait_until

pytestmark = pytest.mark.docker

PING = b'{"jsonrpc":"2.0","id":"__sentinel__","method":"ping"}\n'
CONFIG = """\
pool:
  max_per_user: 2
  min_idle: 1
calls:
  cancel_grace_ms: 1000
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, docker_api: Any) -> Iterator[Daemon]:
    with module_daemon(tmp_path_factory.mktemp("abuse"), docker_api, config=CONFIG) as started:
        yield started


class Wire:
    """A raw connection whose every incoming line is checked to be strict JSON-RPC."""

    def __init__(self, daemon: Daemon, timeout: float = 30) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(daemon.socket))
        self.buffer = b""
        self.pending: list[dict[str, Any]] = []

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sock.close()

    def send(self, data: bytes | dict[str, Any]) -> None:
        self.sock.sendall(data if isinstance(data, bytes) else json.dumps(data).encode() + b"\n")

    def next(self) -> dict[str, Any]:
        while not self.pending:
            chunk = self.sock.recv(1 << 20)
            assert chunk, "the daemon closed the connection"
            self.buffer += chunk
            *lines, self.buffer = self.buffer.split(b"\n")
            for line in lines:
                message = json.loads(line, parse_constant=lambda c: pytest.fail(f"daemon wrote {c}: {line[:200]!r}"))
                assert message.get("jsonrpc") == "2.0", message
                if "error" in message:
                    assert message["error"]["code"] != -32603, message
                self.pending.append(message)
        return self.pending.pop(0)

    def until_sentinel(self) -> list[dict[str, Any]]:
        self.send(PING)
        out = []
        while True:
            message = self.next()
            if message.get("id") == "__sentinel__":
                assert message["result"] == {}
                return out
            out.append(message)

    def answer(self, request_id: Any) -> dict[str, Any]:
        while True:
            message = self.next()
            if message.get("id") == request_id and "method" not in message:
                return message


def status(daemon: Daemon) -> dict[str, Any]:
    for _ in range(500):
        try:
            client = daemon.client()
        except BlockingIOError:  # a unix socket's full listen backlog refuses at once: retry, as clients do
            time.sleep(0.01)
            continue
        with client:
            return client.request("sandbox/status")
    raise AssertionError("the daemon stopped accepting connections")


def test_random_bytes(daemon: Daemon) -> None:
    rng = random.Random(1234)
    with Wire(daemon) as wire:
        for _ in range(20):
            wire.send(rng.randbytes(rng.randint(1, 20000)))
        wire.send(b"\n")
        errors = wire.until_sentinel()
    assert errors and all(e["error"]["code"] in (-32700, -32600) for e in errors)


def test_huge_lines(daemon: Daemon) -> None:
    limit = 16 << 20  # max_message_bytes' default
    with Wire(daemon, timeout=60) as wire:
        wire.send(b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"' + b"a" * (limit + 1000) + b'"}}\n')
        [too_long] = wire.until_sentinel()
        assert too_long["error"]["code"] == -32600 and "longer than" in too_long["error"]["message"]
        # Just under the limit is an ordinary request.
        wire.send(b'{"jsonrpc":"2.0","id":2,"method":"ping","params":{"x":"' + b"b" * (limit - 100) + b'"}}\n')
        assert wire.answer(2)["result"] == {}
        # A line that never ends is skipped up to its end, however far away that is.
        for _ in range(3):
            wire.send(b"c" * (8 << 20))
        wire.send(b"\n")
        [skipped] = wire.until_sentinel()
        assert skipped["error"]["code"] == -32600


def test_deep_nesting(daemon: Daemon) -> None:
    with Wire(daemon) as wire:
        wire.send(b"[" * 1_000_000 + b"\n")
        wire.send(b'{"a":' * 200_000 + b"\n")
        errors = wire.until_sentinel()
        assert [e["error"]["code"] for e in errors] == [-32700, -32700]
        # Nesting the parser accepts, where the daemon must not recurse itself to death:
        # in the arguments (checked against the schema), and in a progress token it echoes.
        deep = json.loads("[" * 900 + "]" * 900)
        wire.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                   "params": {"user": BYSTANDER_A, "name": "hello", "arguments": {"name": deep}}})
        assert wire.answer(3)["error"]["code"] == -32602
        wire.send({"jsonrpc": "2.0", "id": 4, "method": "tools/call",
                   "params": {"user": BYSTANDER_A, "name": "progress", "arguments": {"steps": 2},
                              "_meta": {"progressToken": deep}}})
        answer = wire.answer(4)
        assert "result" in answer or answer["error"]["code"] == -32602, answer
    with daemon.client() as client:
        assert call(client, BYSTANDER_A, "hello", {"name": "still here"})["status"] == "ok"


@pytest.mark.parametrize("payload", [
    b"\xff\xfe\xfd",
    b"\xc0\xaf",  # overlong "/"
    b"\xed\xa0\x80",  # a UTF-16 surrogate encoded as UTF-8
    b"\x80\x80",  # continuation bytes alone
    b"\xf4\x90\x80\x80",  # past U+10FFFF
])
def test_invalid_utf8(daemon: Daemon, payload: bytes) -> None:
    with Wire(daemon) as wire:
        wire.send(b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"' + payload + b'"}}\n')
        [error] = wire.until_sentinel()
    assert error["error"]["code"] == -32700 and "UTF-8" in error["error"]["message"]


def test_thousands_of_connections_opened_and_dropped(daemon: Daemon, docker_api: Any) -> None:
    with daemon.client() as client:
        assert call(client, BYSTANDER_A, "hello", {"name": "warm"})["status"] == "ok"
    # A first round opens what the daemon keeps for good (the engine's connections, a replaced sandbox's
    # shim socket); the second, ten times longer, must leave the count where the first did.
    _connect_and_drop(daemon, 200)
    fds_before = _fd_kinds(daemon)
    _connect_and_drop(daemon, 2000)
    fds_after = _fd_kinds(daemon)
    assert sum(fds_after.values()) <= sum(fds_before.values()) + 5, (fds_before, fds_after)
    assert_pool_recovers(daemon, docker_api, BYSTANDER_A, timeout=30)


def _connect_and_drop(daemon: Daemon, connections: int) -> None:
    """Connections opened and dropped: half a line, a half-close, or a call left in flight (1 in 100)."""
    # Ten minutes of sleep and deadline: only the disconnect can end these calls within the wait below.
    call_line = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                            "params": {"user": BYSTANDER_A, "name": "sleeper", "arguments": {"ms": 600000},
                                       "timeoutMs": 600000}}).encode() + b"\n"
    for i in range(connections):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        for _ in range(200):
            try:
                sock.connect(str(daemon.socket))
                break
            except BlockingIOError:  # the listen backlog is momentarily full
                time.sleep(0.01)
        if i % 4 == 1:
            sock.sendall(b'{"jsonrpc":"2.0","id":1,"meth')  # half a line
        elif i % 100 == 2:
            sock.sendall(call_line)  # a call in flight, abandoned: cancelled by the disconnect
        elif i % 4 == 3:
            sock.shutdown(socket.SHUT_WR)  # half-close first
        sock.close()

    def settled() -> dict[str, Any] | None:
        now = status(daemon)
        return now if now["connections"] == 1 and now["callsInFlight"] == 0 else None

    wait_until(settled, 30, "every dropped connection and its calls to be gone")


def _fd_kinds(daemon: Daemon) -> Counter[str]:
    """The daemon's open descriptors by kind (socket, pipe, anon_inode:[eventpoll], a path's folder)."""
    assert daemon.proc is not None
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{daemon.proc.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{daemon.proc.pid}/fd/{fd}")
        except FileNotFoundError:
            continue  # closed meanwhile
        kinds[target.split(":")[0] if ":" in target else os.path.dirname(target)] += 1
    return kinds


def test_reused_ids(daemon: Daemon) -> None:
    sleeper = {"user": BYSTANDER_A, "name": "sleeper", "arguments": {"ms": 800}}
    with Wire(daemon) as wire:
        wire.send({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": sleeper})
        wire.send({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": sleeper})
        refused = wire.next()
        assert refused["id"] == 5 and refused["error"]["code"] == -32602 and "already used" in refused["error"]["message"]
        assert wire.answer(5)["result"]["status"] == "ok"
        # Once answered, the id is free again; a ping may share it with a call in flight.
        wire.send({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": sleeper})
        wire.send({"jsonrpc": "2.0", "id": 5, "method": "ping"})
        answers = [wire.answer(5), wire.answer(5)]
        assert sorted("status" in a["result"] for a in answers) == [False, True]


def test_cancel_storm(daemon: Daemon, docker_api: Any) -> None:
    rng = random.Random(99)
    ids = [f"storm-{i}" for i in range(6)]
    with Wire(daemon, timeout=60) as wire:
        for request_id in ids:  # max_per_user 2: four of them queue
            wire.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                       "params": {"user": BYSTANDER_A, "name": "sleeper", "arguments": {"ms": 30000}}})
        time.sleep(0.5)
        junk_ids: list[Any] = [None, 0, -1, "storm-99", {"a": 1}, [1], True, 1.5, "x" * 1000]
        storm = []
        for _ in range(10000):
            target = rng.choice(ids) if rng.random() < 0.3 else rng.choice(junk_ids)
            storm.append({"jsonrpc": "2.0", "method": "notifications/cancelled",
                          "params": {"requestId": target, "reason": rng.choice(["storm", "", 7, None])}})
        wire.send(b"".join(json.dumps(m).encode() + b"\n" for m in storm))
        answers: dict[str, dict[str, Any]] = {}
        while len(answers) < len(ids):
            message = wire.next()
            assert message.get("id") in ids and message["id"] not in answers, message
            answers[message["id"]] = message
        assert wire.until_sentinel() == []  # nothing else: no second answers, no errors for notifications
    for request_id, answer in answers.items():
        assert answer["result"]["status"] == "cancelled", (request_id, answer)
    now = status(daemon)
    assert now["callsInFlight"] == 0
    assert_pool_recovers(daemon, docker_api, BYSTANDER_A)
