"""Newline-framed messages from a byte stream: the one splitter the daemon, the shim channel and the client share.

Split on \\n only (U+2028/U+2029 inside JSON strings are not line ends), one trailing
\\r ignored, empty lines dropped. A line longer than ``max_line`` is never held whole:
its bytes are dropped up to its \\n and it comes out once as ``TOO_LONG``, in order with
the lines around it; what that means (answer and go on, or break) is the reader's policy.
"""

from __future__ import annotations

import sys
from typing import Final, Generator


class _TooLong:
    def __repr__(self) -> str:
        return "TOO_LONG"


TOO_LONG: Final = _TooLong()


class LineBuffer:
    def __init__(self, max_line: int | None = None) -> None:
        self.max_line = max_line  # None: no limit (a reader that trusts its peer, like the client)
        self._limit = sys.maxsize if max_line is None else max_line
        self._buffer = bytearray()
        self._skipping = False  # inside an over-long line, dropping bytes up to its \n

    def feed(self, data: bytes) -> Generator[bytes | _TooLong, None, None]:
        """The complete lines ``data`` ends; what a reader that breaks out early leaves comes with the next feed."""
        buffer, limit = self._buffer, self._limit
        buffer += data
        start = 0
        try:
            if self._skipping:  # the over-long line's bytes up to its \n are dropped
                start = buffer.find(b"\n") + 1
                if not start:
                    return
                self._skipping = False
            while (end := buffer.find(b"\n", start)) >= 0:
                line_start, start = start, end + 1
                if end - line_start > limit:
                    yield TOO_LONG
                    continue
                if end > line_start and buffer[end - 1] == 0x0D:  # \r
                    end -= 1
                if end > line_start:
                    yield bytes(buffer[line_start:end])
            if len(buffer) - start > limit:
                self._skipping = True
                yield TOO_LONG
        finally:
            if self._skipping:
                buffer.clear()
            else:
                del buffer[:start]

    def take_rest(self) -> bytes:
        """What was fed and not yet handed out as a line, emptied: the raw bytes after a raw request (server/raw.py)."""
        rest = b"" if self._skipping else bytes(self._buffer)
        self._buffer.clear()
        return rest
