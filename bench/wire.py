"""Blocking line readers for the two transports measured: the daemon's unix socket
and a raw docker attach stream. Deliberately minimal, so that the client costs as
little as possible on the timed path (no JSON on the way out: requests are
pre-encoded bytes).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

_FRAME = struct.Struct(">BxxxL")  # docker's stream multiplexing header (tty=False)


class LineSocket:
    """A connection to the daemon's socket: send bytes, read replies line by line."""

    def __init__(self, path: str, timeout: float | None = 120.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self._buffer = bytearray()
        self._ids = 0

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_line(self) -> bytes:
        buffer = self._buffer
        while True:
            end = buffer.find(b"\n")
            if end >= 0:
                line = bytes(buffer[:end])
                del buffer[: end + 1]
                return line
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("sandboxd closed the connection")
            buffer += chunk

    def request(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """One request, answered; notifications in between are skipped. Raises on a JSON-RPC error."""
        self._ids += 1
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": f"r{self._ids}", "method": method}
        if params is not None:
            message["params"] = params
        self.send(json.dumps(message).encode() + b"\n")
        while True:
            reply = json.loads(self.read_line())
            if reply.get("id") != message["id"]:
                continue
            if "error" in reply:
                raise RuntimeError(f"{method} failed: {reply['error']}")
            return reply["result"]


class AttachLines:
    """The stdout lines of a docker attach socket (stderr frames are dropped)."""

    def __init__(self, sock: socket.socket, handle: Any = None) -> None:
        self.sock = sock
        self._handle = handle  # the SDK's wrapper; closing it alone leaves the socket open
        self._frames = bytearray()
        self._stdout = bytearray()

    def close(self) -> None:
        """Detach for real: an attach left open still gets the container's output, and
        once nobody reads it, Docker blocks the container's stdout for every attach."""
        self.sock.close()
        if self._handle is not None:
            self._handle.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_line(self) -> bytes:
        while True:
            end = self._stdout.find(b"\n")
            if end >= 0:
                line = bytes(self._stdout[:end])
                del self._stdout[: end + 1]
                return line
            self._fill()

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the container's attach stream ended")
        frames = self._frames
        frames += chunk
        offset = 0
        while len(frames) - offset >= 8:
            stream, size = _FRAME.unpack_from(frames, offset)
            if len(frames) - offset - 8 < size:
                break
            if stream == 1:
                self._stdout += frames[offset + 8 : offset + 8 + size]
            offset += 8 + size
        del frames[:offset]


def attach(api: Any, container_id: str) -> AttachLines:
    """Attach (stdin+stdout+stderr, no logs) the way the daemon does. Close it when done."""
    handle = api.attach_socket(container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1, "logs": 0})
    raw = getattr(handle, "_sock", handle)
    raw.settimeout(120.0)
    return AttachLines(raw, handle)
