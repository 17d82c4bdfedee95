"""Issue 11, items 2 and 6, against a real daemon and real Docker.

- A user's hostile TOOL.md (the nested-alias YAML bomb, a tree of manifests that are
  expensive but within every bound, a tools root that is a link to another user's)
  delays no other user's ping, tools/list or tools/call, and is skipped with a
  problem in the daemon's log.
- Every bad request shape gets its own clear code (-32602 or -32600), never -32603,
  and a user is one user whatever the case of their address.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from sandboxd.client import RpcError
from tests.e2e.conftest import Daemon
from tests.e2e.hostile_harness import module_daemon

pytestmark = pytest.mark.docker

ALICE, MALLORY = "alice@example.com", "mallory@example.com"
CONFIG = "pool:\n  max_per_user: 2\n  min_idle: 1\n"
# Far from both ends: the measured stall on main was 30 s for a ping and 115 s for a
# listing; a bystander on two busy cores answers in milliseconds.
BYSTANDER_BOUND_S = 5.0


def yaml_bomb(name: str, levels: int = 8) -> str:
    """Issue 11's ~600-byte TOOL.md: eight levels of nested aliases as an input's default."""
    lines = ["---", f"name: {name}", "description: Boom.", "version: 1", "inputs:", "  q:", "    type: string",
             "    description: Q.", "    default:", "      - &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"      - &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines + ["---", "# Bomb", ""])


def heavy_manifest(name: str) -> str:
    """A TOOL.md inside every bound (under 64 KiB of frontmatter, under 10,000 values) that is slow to read."""
    values = "".join(f"      - v{index}\n" for index in range(4300))
    return (f"---\nname: {name}\ndescription: Heavy.\nversion: 1\ninputs:\n  q:\n    type: enum\n"
            f"    description: Q.\n    values:\n{values}---\n# {name}\n")


def write_user_tool(daemon: Daemon, user: str, dirname: str, manifest: str) -> Path:
    tool = daemon.user_dir(user) / "tools" / dirname
    tool.mkdir(parents=True, exist_ok=True)
    (tool / "TOOL.md").write_text(manifest)
    (tool / "index.ts").write_text("export async function execute() { return { content: [] }; }\n")
    return tool


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    started = time.monotonic()
    result = action()
    return time.monotonic() - started, result


def wait_for_log(daemon: Daemon, text: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = daemon.log_path.read_text(errors="replace")
        if text in log:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in the daemon's log:\n{daemon.log()}")


class Bystander:
    """Alice, pinging, listing and calling in a loop while something else goes on; keeps the worst latencies."""

    def __init__(self, daemon: Daemon) -> None:
        self.client = daemon.client(timeout=120)
        self.worst = {"ping": 0.0, "tools/list": 0.0, "tools/call": 0.0}
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(150)
        self.client.close()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for method, action in (
                    ("ping", lambda: self.client.request("ping")),
                    ("tools/list", lambda: self.client.request("tools/list", {"user": ALICE})),
                    ("tools/call", lambda: self.client.call_tool(ALICE, "hello", {"name": "Alice"})),
                ):
                    elapsed, result = timed(action)
                    if method == "tools/call":
                        assert result["status"] == "ok", result
                    self.worst[method] = max(self.worst[method], elapsed)
                self.rounds += 1
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc


def test_a_yaml_bomb_in_a_users_tool_md_delays_no_bystander(make_daemon: Any) -> None:
    daemon = make_daemon(CONFIG)
    with daemon.client() as client:  # alice warm: her calls need no new sandbox meanwhile
        assert client.call_tool(ALICE, "hello", {"name": "Alice"})["status"] == "ok"
    for index in range(4):  # one took 4.4 s of the loop on main here; four, far past the bound
        write_user_tool(daemon, MALLORY, f"bomb_{index}", yaml_bomb(f"bomb_{index}"))
    assert len((daemon.user_dir(MALLORY) / "tools" / "bomb_0" / "TOOL.md").read_bytes()) < 700
    with Bystander(daemon) as alice, daemon.client(timeout=300) as mallory:
        elapsed, listing = timed(lambda: mallory.request("tools/list", {"user": MALLORY}))
        with pytest.raises(RpcError) as refused:
            mallory.call_tool(MALLORY, "bomb_0", {"q": "x"})
        while alice.rounds < 2 and alice.error is None:
            time.sleep(0.01)
    assert alice.error is None, alice.error
    assert all(worst < BYSTANDER_BOUND_S for worst in alice.worst.values()), alice.worst
    assert elapsed < BYSTANDER_BOUND_S, f"mallory's own listing took {elapsed:.1f} s"
    assert not [tool["name"] for tool in listing["tools"] if tool["name"].startswith("bomb")]
    assert refused.value.code == -32602 and "unknown tool 'bomb_0'" in refused.value.message
    log = wait_for_log(daemon, "anchors and aliases")
    assert "tool_skipped" in log and str(daemon.user_dir(MALLORY) / "tools" / "bomb_3") in log


def test_a_tree_of_slow_manifests_is_read_off_the_event_loop(make_daemon: Any) -> None:
    """Each manifest within every bound, together seconds of parsing: none of it on the loop."""
    daemon = make_daemon(CONFIG)
    with daemon.client() as client:
        assert client.call_tool(ALICE, "hello", {"name": "Alice"})["status"] == "ok"
    for index in range(40):
        write_user_tool(daemon, MALLORY, f"heavy_{index:02d}", heavy_manifest(f"heavy_{index:02d}"))
    with Bystander(daemon) as alice, daemon.client(timeout=300) as mallory:
        elapsed, listing = timed(lambda: mallory.request("tools/list", {"user": MALLORY}))
        while alice.rounds < 2 and alice.error is None:
            time.sleep(0.01)
    assert alice.error is None, alice.error
    # Evidence that the scan was heavy: were it on the event loop, alice would have waited as long.
    assert elapsed > 1.5, f"mallory's listing took only {elapsed:.2f} s: too fast to show anything; add manifests"
    # Measured: a 5 s scan, alice's worst call 0.23 s (the worker holds the GIL in turns).
    assert all(worst < min(2.5, elapsed / 2) for worst in alice.worst.values()), (elapsed, alice.worst)
    listed = [tool["name"] for tool in listing["tools"] if tool["name"].startswith("heavy_")]
    # The root's 2 MiB TOOL.md budget, or its 5 s time limit, leaves some out; with a problem each.
    assert 0 < len(listed) < 40
    log = wait_for_log(daemon, "tool_skipped")
    assert "add up to more than" in log or "took longer than" in log


def test_a_user_tools_root_linked_to_another_users_is_refused(make_daemon: Any) -> None:
    daemon = make_daemon(CONFIG)
    write_user_tool(daemon, ALICE, "alices_secret", "---\nname: alices_secret\ndescription: Alice's.\n"
                                                    "version: 1\n---\n# Secret\n")
    daemon.user_dir(MALLORY).mkdir(parents=True)
    (daemon.user_dir(MALLORY) / "tools").symlink_to(daemon.user_dir(ALICE) / "tools")
    with daemon.client() as client:
        names = [tool["name"] for tool in client.request("tools/list", {"user": MALLORY})["tools"]]
        assert "alices_secret" not in names and "hello" in names
        with pytest.raises(RpcError) as refused:
            client.call_tool(MALLORY, "alices_secret", {})
        assert refused.value.code == -32602
        assert "alices_secret" in [tool["name"] for tool in client.request("tools/list", {"user": ALICE})["tools"]]
    log = wait_for_log(daemon, "symbolic link")
    assert f"rm {daemon.user_dir(MALLORY) / 'tools'} && mkdir" in log


def test_a_tool_md_that_is_a_fifo_or_a_device_is_never_opened(make_daemon: Any) -> None:
    import os

    daemon = make_daemon(CONFIG)
    fifo_tool = write_user_tool(daemon, MALLORY, "fifo", "")
    (fifo_tool / "TOOL.md").unlink()
    os.mkfifo(fifo_tool / "TOOL.md")
    device_tool = write_user_tool(daemon, MALLORY, "device", "")
    (device_tool / "TOOL.md").unlink()
    (device_tool / "TOOL.md").symlink_to("/dev/zero")
    opened = threading.Event()

    def writer() -> None:
        fd = os.open(fifo_tool / "TOOL.md", os.O_WRONLY)  # returns once a reader opens the FIFO
        opened.set()
        os.close(fd)

    threading.Thread(target=writer, daemon=True).start()
    with daemon.client(timeout=30) as client:
        names = [tool["name"] for tool in client.request("tools/list", {"user": MALLORY})["tools"]]
    assert "fifo" not in names and "device" not in names
    log = wait_for_log(daemon, str(device_tool))
    assert log.count("TOOL.md is not a regular file") >= 2
    try:
        assert not opened.wait(0.5), "the daemon opened the FIFO"
    finally:
        os.close(os.open(fifo_tool / "TOOL.md", os.O_RDONLY | os.O_NONBLOCK))  # let the writer go


# --- bad requests ----------------------------------------------------------------------------


class Wire:
    """A raw connection: lines out, answers in, every answer strict JSON and never -32603."""

    def __init__(self, daemon: Daemon) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(daemon.socket))
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def ask(self, line: bytes) -> dict[str, Any]:
        self.sock.sendall(line + b"\n")
        while b"\n" not in self.buffer:
            chunk = self.sock.recv(1 << 20)
            assert chunk, "the daemon closed the connection"
            self.buffer += chunk
        answer, self.buffer = self.buffer.split(b"\n", 1)
        message = json.loads(answer, parse_constant=lambda c: pytest.fail(f"daemon wrote {c}"))
        assert message.get("error", {}).get("code") != -32603, message
        return message


CALL = b'"method":"tools/call","params":{"user":"alice@example.com","name":"hello",'
BAD_REQUESTS = {
    "tools/list, user a list": (b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"user":["alice@example.com"]}}',
                                -32602, 1),
    "tools/list, user an object": (b'{"jsonrpc":"2.0","id":2,"method":"tools/list","params":{"user":{"a":1}}}', -32602, 2),
    "tools/list, user with a newline": (b'{"jsonrpc":"2.0","id":3,"method":"tools/list",'
                                        b'"params":{"user":"alice@example.com\\n"}}', -32602, 3),
    "tools/call, user with a newline": (b'{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"user":'
                                        b'"alice@example.com\\n","name":"hello","arguments":{"name":"x"}}}', -32602, 4),
    "a 400-digit argument": (b'{"jsonrpc":"2.0","id":5,' + CALL + b'"arguments":{"name":' + b"9" * 400 + b"}}}",
                             -32602, 5),
    "a 400-digit id": (b'{"jsonrpc":"2.0","id":' + b"9" * 400 + b',"method":"ping"}', -32600, None),
    "a duplicate key at the top": (b'{"jsonrpc":"2.0","id":6,"method":"ping","method":"tools/list"}', -32600, None),
    "a duplicate key in arguments": (b'{"jsonrpc":"2.0","id":7,' + CALL + b'"arguments":{"name":"x","name":"y"}}}',
                                     -32600, None),
    "a duplicate user": (b'{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"user":"alice@example.com",'
                         b'"user":"bob@example.com","name":"hello","arguments":{"name":"x"}}}', -32600, None),
    "a progress token object": (b'{"jsonrpc":"2.0","id":9,' + CALL + b'"arguments":{"name":"x"},'
                                b'"_meta":{"progressToken":{"a":1}}}}', -32602, 9),
}


@pytest.fixture(scope="module")
def wire_daemon(tmp_path_factory: pytest.TempPathFactory, docker_api: Any) -> Iterator[Daemon]:
    with module_daemon(tmp_path_factory.mktemp("requests"), docker_api, config=CONFIG) as started:
        yield started


@pytest.mark.parametrize("shape", list(BAD_REQUESTS))
def test_every_bad_request_shape_gets_its_code(wire_daemon: Daemon, shape: str) -> None:
    line, code, request_id = BAD_REQUESTS[shape]
    wire = Wire(wire_daemon)
    try:
        answer = wire.ask(line)
        assert (answer["id"], answer["error"]["code"]) == (request_id, code), answer
        assert answer["error"]["message"]
        assert wire.ask(b'{"jsonrpc":"2.0","id":"after","method":"ping"}') == {"jsonrpc": "2.0", "id": "after",
                                                                               "result": {}}
    finally:
        wire.close()


def test_nesting_at_the_parsers_limit_is_a_clear_error(wire_daemon: Daemon) -> None:
    wire = Wire(wire_daemon)
    try:
        depth = 1100
        while "result" not in wire.ask(b'{"jsonrpc":"2.0","id":0,"method":"ping","params":'
                                       + b"[" * depth + b"]" * depth + b"}"):
            depth -= 1  # the deepest the daemon's parser takes, found from above
        deep = b"[" * (depth - 4) + b"]" * (depth - 4)
        for request_id, params in enumerate([
            b'{"user":' + deep + b"}",
            b'{"user":"alice@example.com","name":"hello","arguments":{"name":' + deep + b"}}",
            b'{"user":"alice@example.com","name":"hello","arguments":{"name":"x"},"env":{"PI_SEARXNG_URL":' + deep + b"}}",
            b'{"user":"alice@example.com","name":"hello","arguments":{"name":"x"},"_meta":{"progressToken":' + deep + b"}}",
        ], start=1):
            method = b"tools/list" if request_id == 1 else b"tools/call"
            answer = wire.ask(b'{"jsonrpc":"2.0","id":%d,"method":"%s","params":%s}' % (request_id, method, params))
            assert (answer["id"], answer["error"]["code"]) == (request_id, -32602), answer
        too_deep = b"[" * (depth + 10) + b"]" * (depth + 10)
        answer = wire.ask(b'{"jsonrpc":"2.0","id":9,"method":"ping","params":' + too_deep + b"}")
        assert answer["error"]["code"] == -32700 and "nested too deeply" in answer["error"]["message"]
    finally:
        wire.close()


def test_a_user_in_another_case_is_the_same_user(wire_daemon: Daemon) -> None:
    with wire_daemon.client() as client:
        assert client.call_tool("Alice@Example.COM", "hello", {"name": "x"})["status"] == "ok"
        assert client.call_tool(ALICE, "hello", {"name": "x"})["status"] == "ok"
        users = client.request("sandbox/status")["pool"]["users"]
    assert list(users) == [ALICE], users
