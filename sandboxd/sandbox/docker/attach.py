"""docker attach: the container's output stream, in Docker's frames.

With ``tty=False`` stdout and stderr come multiplexed in frames with an 8-byte header
(``>BxxxL``: stream 1 = stdout, 2 = stderr, then the payload's length); frame boundaries
do not follow line boundaries, nor the reads'.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

STDOUT = 1
_FRAME = struct.Struct(">BxxxL")


class Frames:
    """Docker's frames, from reads that cut them anywhere."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The (stream, payload) of every frame ``data`` completes; the rest waits for the next read."""
        buffer = self._buffer
        buffer += data
        frames = []
        offset = 0
        while len(buffer) - offset >= _FRAME.size:
            stream, size = _FRAME.unpack_from(buffer, offset)
            if len(buffer) - offset - _FRAME.size < size:
                break
            start = offset + _FRAME.size
            frames.append((stream, bytes(buffer[start : start + size])))
            offset = start + size
        del buffer[:offset]
        return frames


def frame(stream: int, payload: bytes) -> bytes:
    """One frame as Docker writes it (for tests)."""
    return _FRAME.pack(stream, len(payload)) + payload


def attach_socket(api: Any, container_id: str, *, with_stdin: bool) -> Any:
    """The attach connection of a created container (blocking); its raw socket is non-blocking.

    Attach before start with logs=0, so no early output is lost or replayed.
    """
    sock = api.attach_socket(
        container_id, params={"stdin": int(with_stdin), "stdout": 1, "stderr": 1, "stream": 1, "logs": 0}
    )
    raw = raw_socket(sock)
    raw.settimeout(None)  # the SDK leaves a 60 s timeout on it
    raw.setblocking(False)
    return sock


def raw_socket(attach: Any) -> Any:
    """Over a unix socket the SDK returns a SocketIO wrapper; the socket is its ``_sock``."""
    return getattr(attach, "_sock", attach)


def set_reading(transport: asyncio.Transport | None, on: bool) -> None:
    if transport is None or transport.is_closing() or transport.is_reading() == on:
        return
    if on:
        transport.resume_reading()
    else:
        transport.pause_reading()
