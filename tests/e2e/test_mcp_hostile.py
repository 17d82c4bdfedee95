"""`sandboxd mcp` against hostile or broken hosts on stdio: bad lines, huge lines, a host that never reads.

Raw pipes, no SDK client: what a host could send, byte for byte. Memory is read from the
server's /proc status (VmHWM, its peak resident set).
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO, write_tool
from tests.e2e.mcp_session import USER, mcp_command, server_env

pytestmark = pytest.mark.docker

INITIALIZE = {"jsonrpc": "2.0", "id": "init", "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                         "clientInfo": {"name": "hostile", "version": "1"}}}
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


class RawHost:
    """`sandboxd mcp` as a child with plain pipes; ``read`` waits for the next line it writes."""

    def __init__(self, daemon: Any, *, reading: bool = True) -> None:
        self.daemon = daemon
        self.proc = subprocess.Popen(mcp_command(daemon), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(daemon.tmp / "mcp-hostile.log", "ab"), env=server_env(), cwd=REPO)
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.reading = reading
        if reading:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def send(self, message: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(message if isinstance(message, bytes) else json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 20) -> dict[str, Any]:
        """The next answer; notifications (a list_changed can come at any time) are skipped."""
        deadline = time.monotonic() + timeout
        while True:
            message: dict[str, Any] = json.loads(self.lines.get(timeout=max(0.1, deadline - time.monotonic())))
            if "id" in message or "method" not in message:
                return message

    def answer(self, request_id: Any, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            message = self.read(max(0.1, deadline - time.monotonic()))
            if message.get("id") == request_id:
                return message

    def initialize(self) -> None:
        self.send(INITIALIZE)
        assert self.answer("init")["result"]["serverInfo"]["name"] == "sandboxd"
        self.send(INITIALIZED)

    def warm_up(self) -> int:
        """One call made (the server's first call imports and builds what later ones reuse); its resident KiB after."""
        self.send({"jsonrpc": "2.0", "id": "warm", "method": "tools/call",
                   "params": {"name": "hello", "arguments": {"name": "warm"}}})
        if self.reading:
            assert self.answer("warm")["result"]["content"][0]["text"] == "Hello, warm!"
        else:
            # Unread, the answer is seen in the daemon's log; a fixed sleep measured a busy machine's
            # first call still importing as if it were growth.
            deadline = time.monotonic() + 60
            while not self.daemon.events("call", tool="hello") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert self.daemon.events("call", tool="hello"), "the warm-up call never ran"
            time.sleep(0.5)  # its answer written to the pipe
        return memory_kib(self.proc.pid, "VmRSS")

    def close(self) -> int:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("sandboxd mcp did not exit when its host went away")


def test_every_malformed_line_is_answered_and_the_stream_goes_on(make_daemon: Any) -> None:
    daemon = make_daemon()
    host = RawHost(daemon)
    try:
        cases = [
            (b"this is not json\n", -32700, None),
            (b'{"jsonrpc": "2.0", "id": 1, "method": "ping"\n', -32700, None),  # cut short
            (b"\xff\xfe{}\n", -32700, None),  # not UTF-8
            (b"[" * 100_000 + b"]" * 100_000 + b"\n", -32700, None),  # nesting no parser should recurse into
            (b'[{"jsonrpc": "2.0", "id": 2, "method": "ping"}]\n', -32600, None),  # a batch
            (b'{"jsonrpc": "1.0", "id": 3, "method": "ping"}\n', -32600, 3),
            (b'{"jsonrpc": "2.0", "id": 4, "method": 17}\n', -32600, 4),
            (b'{"jsonrpc": "2.0", "id": {"an": "object"}, "method": "ping"}\n', -32600, None),
            (b"42\n", -32600, None),
        ]
        for line, code, request_id in cases:
            host.send(line)
            error = host.read()
            assert (error["error"]["code"], error["id"]) == (code, request_id), (line[:60], error)
        host.initialize()  # the same stream still serves
        host.send({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "hello", "arguments": {"name": "x"}}})
        assert host.answer(9)["result"]["content"][0]["text"] == "Hello, x!"
    finally:
        assert host.close() == 0


def test_a_line_over_max_message_bytes_is_skipped_unread_and_answered(make_daemon: Any) -> None:
    daemon = make_daemon("max_message_bytes: 1048576\n")
    host = RawHost(daemon)
    try:
        host.initialize()
        baseline = host.warm_up()
        huge = b'{"jsonrpc":"2.0","id":"huge","method":"tools/call","params":{"name":"hello","arguments":{"name":"'
        host.send(huge + b"A" * (96 << 20) + b'"}}}\n')  # 96 MiB in one line
        error = host.read()
        print(f"peak memory grew by {memory_kib(host.proc.pid, 'VmHWM') - baseline} KiB for a 96 MiB line")
        assert error["error"]["code"] == -32600 and "longer than 1048576 bytes" in error["error"]["message"], error
        host.send({"jsonrpc": "2.0", "id": 2, "method": "ping"})
        assert host.answer(2)["result"] == {}
        grown = memory_kib(host.proc.pid, "VmHWM") - baseline
        assert grown < 8 << 10, f"the server's peak memory grew by {grown} KiB for a line it should skip"
    finally:
        host.close()


def test_a_host_that_never_reads_stalls_itself_not_the_servers_memory(make_daemon: Any) -> None:
    daemon = make_daemon()
    host = RawHost(daemon, reading=False)
    name = "N" * (64 << 10)
    requests = [json.dumps({"jsonrpc": "2.0", "id": n, "method": "tools/call",
                            "params": {"name": "hello", "arguments": {"name": name}}}).encode() + b"\n"
                for n in range(400)]  # 400 answers of 64 KiB, none of them read
    sent = [0]

    def flood() -> None:
        try:
            for request in requests:
                host.send(request)
                sent[0] += 1
        except (BrokenPipeError, ValueError, OSError):
            pass

    try:
        host.send(INITIALIZE)
        host.send(INITIALIZED)
        baseline = host.warm_up()
        writer = threading.Thread(target=flood, daemon=True)
        writer.start()
        writer.join(15)
        assert writer.is_alive(), "the server read every request although nothing of its answers was read"
        assert sent[0] < 200, f"{sent[0]} requests were read in"
        grown = memory_kib(host.proc.pid, "VmHWM") - baseline
        print(f"{sent[0]} requests read in, peak memory grew by {grown} KiB")
        assert grown < 48 << 10, f"the server's peak memory grew by {grown} KiB"
        # The daemon is not held up by it: another client is served at once.
        with daemon.client(timeout=10) as other:
            other_call = other.call_tool("other@example.com", "hello", {"name": "bystander"})
        assert other_call["content"][0]["text"] == "Hello, bystander!"
    finally:
        host.proc.kill()
        host.proc.wait()


def test_progress_a_host_does_not_read_is_dropped_not_kept(make_daemon: Any) -> None:
    daemon = make_daemon()
    tool = daemon.user_dir(USER) / "tools" / "chatty"
    tool.mkdir(parents=True)
    (tool / "TOOL.md").write_text("---\nname: chatty\ndescription: Reports a lot.\nversion: 1\n---\n# chatty\n")
    (tool / "index.ts").write_text(
        "export async function execute(_id: string, _p: unknown, _s?: AbortSignal, onUpdate?: (u: unknown) => void) {\n"
        "  const line = 'x'.repeat(2048);\n"
        "  for (let i = 0; i < 20000; i++) onUpdate?.({ content: [{ type: 'text', text: line }] });\n"
        "  return { content: [{ type: 'text', text: 'said it all' }] };\n"
        "}\n")
    host = RawHost(daemon, reading=False)
    try:
        host.send(INITIALIZE)
        host.send(INITIALIZED)
        baseline = host.warm_up()
        host.send({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                   "params": {"name": "chatty", "arguments": {}, "_meta": {"progressToken": "p"}}})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not daemon.events("call", tool="chatty"):
            time.sleep(0.2)
        assert [c["status"] for c in daemon.events("call", tool="chatty")] == ["ok"], daemon.log()
        grown = memory_kib(host.proc.pid, "VmHWM") - baseline
        print(f"peak memory grew by {grown} KiB for 40 MiB of unread progress")
        assert grown < 8 << 10, f"the server's peak memory grew by {grown} KiB for 40 MiB of unread progress"
    finally:
        host.proc.kill()
        host.proc.wait()


def evil_tool(daemon: Any) -> Path:
    """A user tool that, if it ever runs, leaves a file in the user's folder (seen from the host)."""
    write_tool(daemon.user_dir(USER) / "tools", "evil",
               "import { writeFileSync } from 'node:fs';\n"
               "export async function execute() {\n"
               "  writeFileSync('/officer/user/evil-ran.txt', 'ran');\n"
               "  return { content: [{ type: 'text', text: 'evil ran' }] };\n"
               "}\n", inputs="  name:\n    type: string\n    description: Ignored.\n")
    return daemon.user_dir(USER) / "evil-ran.txt"


# Which "name" wins is up to the parser: the SDK's keeps the last, so without the check evil ran.
DUPLICATE_NAME = (b'{"jsonrpc": "2.0", "id": 5, "method": "tools/call", '
                  b'"params": {"name": "hello", "name": "evil", "arguments": {"name": "x"}}}')


def test_a_key_given_twice_is_refused_never_run(make_daemon: Any) -> None:
    daemon = make_daemon()
    ran = evil_tool(daemon)
    host = RawHost(daemon)
    try:
        host.initialize()
        host.send(DUPLICATE_NAME + b"\n")
        error = host.answer(5)
        assert error["error"]["code"] == -32600, error
        assert 'the key "name" appears twice' in error["error"]["message"], error
        host.send(b'{"jsonrpc": "2.0", "id": 6, "id": 7, "method": "ping"}\n')  # which id? none is guessed
        refused = host.read()
        assert refused["id"] is None and 'the key "id" appears twice' in refused["error"]["message"], refused
        host.send({"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {"name": "hello", "arguments": {"name": "x"}}})
        assert host.answer(8)["result"]["content"][0]["text"] == "Hello, x!"  # the stream goes on
        assert not ran.exists(), "the tool named by the second key ran"
    finally:
        assert host.close() == 0
