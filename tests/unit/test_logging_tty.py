"""`sandboxd serve` logs for a person on a terminal and JSON lines through a pipe (log_format: auto).

A real daemon (the process backend: a real node shim, no Docker needed) runs with its stderr on a
pseudo-terminal or a pipe. Its one user tool is hostile: it writes terminal escape sequences and
its secret argument to stderr, which the daemon logs (``tool_stderr``, at debug); the client is
hostile too: its toolCallId is escape sequences without a space (the ``call`` event logs it at info).
On the terminal the sequences must arrive escaped (neither may drive the operator's terminal) and
the secret masked; the console lines are coloured unless NO_COLOR is set.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

USER = "alice@example.com"
SECRET = "tty-secret-token-9731"
# OSC 0 (set the window title), ED (clear the screen), and C1 CSI (SGR red): each one a terminal would act on.
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x9b31m"
HOSTILE_ESCAPED = "\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m"
# Nothing for the console renderer to quote it for (no space, no quote): only the escaping stands in the way.
CALL_ID = "\x1b]2;pwned-id\x07\x1b[2J"
CALL_ID_ESCAPED = "'\\x1b]2;pwned-id\\x07\\x1b[2J'"  # quoted as repr() has it
TOOL = r"""
export async function execute(_id: string, params: { token: string }) {
  console.error("shout \u001b]0;pwned\u0007\u001b[2J\u009b31m token=" + params.token);
  return { content: [{ type: "text", text: "done" }] };
}
"""

pytestmark = pytest.mark.usefixtures("isolated_config")


def setup_daemon(tmp_path: Path) -> tuple[list[str], dict[str, str], Path]:
    data = tmp_path / "data"
    tool = data / USER / "tools" / "shout"
    tool.mkdir(parents=True)
    (tool / "TOOL.md").write_text("---\nname: shout\ndescription: Writes escapes to stderr.\nversion: 1\ninputs:\n"
                                  "  token:\n    type: string\n    description: A secret.\n    sensitive: true\n"
                                  "---\n# shout\n")
    (tool / "index.ts").write_text(TOOL)
    (tmp_path / "seed").mkdir()
    sock = tmp_path / "s.sock"
    args = [sys.executable, "-m", "sandboxd", "serve", "--backend", "process", "--socket", str(sock),
            "--seed-tools", str(tmp_path / "seed"), "--log-level", "debug"]
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    env |= {"SANDBOXD_DATA_PATH": str(data), "SANDBOXD_ALLOW_UNSAFE": "[unsandboxed]", "TERM": "xterm-256color"}
    return args, env, sock


def call_shout(sock: Path) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(60)
        conn.connect(str(sock))
        request = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"user": USER, "name": "shout", "toolCallId": CALL_ID, "arguments": {"token": SECRET}}}
        conn.sendall(json.dumps(request).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(65536)
            assert chunk, f"the daemon closed the connection: {reply!r}"
            reply += chunk
    answer: dict[str, Any] = json.loads(reply)
    return answer


class Output:
    """Everything the daemon wrote on one file descriptor, read as it comes (a full pty would block it)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.data = fd, b""

    def read_until(self, needle: bytes, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.data:
            left = deadline - time.monotonic()
            assert left > 0, f"no {needle!r} within {timeout} s in:\n{self.data.decode(errors='replace')[-3000:]}"
            if not self.pump(left):
                raise AssertionError(f"the daemon's output ended before {needle!r}:\n{self.data.decode(errors='replace')}")

    def pump(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: the pty's other side is closed
            return False
        self.data += chunk
        return bool(chunk)

    def drain(self) -> str:
        while self.pump(5):
            pass
        return self.data.decode("utf-8", "replace")


def run_daemon(tmp_path: Path, *, tty: bool, env_extra: dict[str, str] | None = None) -> str:
    """Start `sandboxd serve`, make the hostile call, stop it; everything it wrote on stderr."""
    args, env, sock = setup_daemon(tmp_path)
    env |= env_extra or {}
    if tty:
        master, replica = pty.openpty()
        proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=replica, stderr=replica)
        os.close(replica)
        out = Output(master)
    else:
        proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        assert proc.stderr is not None
        out = Output(proc.stderr.fileno())
    try:
        out.read_until(b"listening")
        answer = call_shout(sock)
        assert answer.get("result", {}).get("content") == [{"type": "text", "text": "done"}], answer
        out.read_until(b"pwned-id")  # the call event, escaped or not
        out.read_until(b"shout")  # the tool's stderr line
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        return out.drain()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if tty:
            os.close(master)
        elif proc.stderr is not None:
            proc.stderr.close()


def test_on_a_terminal_lines_for_a_person_coloured_with_escapes_and_secrets_neutralised(tmp_path: Path) -> None:
    text = run_daemon(tmp_path, tty=True)
    lines = [line.rstrip("\r") for line in text.splitlines() if line.strip()]
    assert not [line for line in lines if line.startswith("{")], "JSON on a terminal"
    listening = next(line for line in lines if "listening" in line)
    assert "\x1b[" in listening and "info" in listening  # the renderer's colours, for a person
    shout = next(line for line in lines if "tool_stderr" in line and "shout" in line)
    assert HOSTILE_ESCAPED in shout, shout
    call = next(line for line in lines if "tool_call_id" in line and "duration_ms" in line)
    assert CALL_ID_ESCAPED in call, call
    for raw in ("\x1b]", "\x07", "\x1b[2J", "\x9b"):
        assert raw not in text, f"the tool's or the client's {raw!r} reached the terminal"
    assert SECRET not in text and "token=***" in shout


def test_no_colour_when_asked(tmp_path: Path) -> None:
    text = run_daemon(tmp_path, tty=True, env_extra={"NO_COLOR": "1"})
    assert "\x1b" not in text and "listening" in text and not text.lstrip().startswith("{")
    assert HOSTILE_ESCAPED in text and CALL_ID_ESCAPED in text


def test_through_a_pipe_json_lines(tmp_path: Path) -> None:
    text = run_daemon(tmp_path, tty=False)
    events = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is JSON
    assert "listening" in [e["event"] for e in events]
    shout = next(e for e in events if e["event"] == "tool_stderr" and "shout" in e["line"])
    assert HOSTILE in shout["line"] and "\x1b" not in text  # json escapes it: \u001b
    assert CALL_ID in [e.get("tool_call_id") for e in events if e["event"] == "call"]
    assert SECRET not in text and "token=***" in shout["line"]
