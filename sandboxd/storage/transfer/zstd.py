"""A zstd stream read with its decompressed size bounded: a small archive cannot expand without end (a zstd bomb)."""

from __future__ import annotations

from typing import IO, Callable, cast

import zstandard

from sandboxd.storage.transfer.manifest import ArchiveRefused

MAGIC = b"\x28\xb5\x2f\xfd"


class _Source:
    def __init__(self, read: Callable[[int], bytes]) -> None:
        self.read = read


class BoundedZstdReader:
    """``read(n)`` of the decompressed stream from ``source`` (a read of compressed bytes), n bytes at most at a
    time (never more in memory); past ``limit`` decompressed bytes, ArchiveRefused. A frame cut short is a
    truncated archive."""

    def __init__(self, source: Callable[[int], bytes], limit: int) -> None:
        self._reader = zstandard.ZstdDecompressor().stream_reader(cast(IO[bytes], _Source(source)), read_size=1 << 16)
        self._limit = limit
        self._out = 0

    def read(self, n: int) -> bytes:
        try:
            piece = self._reader.read(min(n, self._limit - self._out + 1))
        except zstandard.ZstdError as exc:
            raise ArchiveRefused("the archive", f"it is not a whole zstd stream ({exc})") from None
        self._out += len(piece)
        if self._out > self._limit:
            raise ArchiveRefused("the archive", f"it decompresses to more than {self._limit} bytes, more than the "
                                                "user's quota can hold (a zstd bomb?)")
        return piece
