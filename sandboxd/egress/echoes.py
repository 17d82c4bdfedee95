"""What comes back from a secret's host: the answer as the tool gets it, never with a real value in it.

A host can hand a value back: a ``301`` to ``https://$host$request_uri`` repeats the query
the proxy put it in, an error page quotes the key. So the answer to a request that went to
one of a secret's hosts passes through ``AnswerScrubber`` on its way to the sandbox:

- in the head (every head, 1xx ones too), each value, as written or percent-encoded (a
  space also as ``+``), becomes the call's stand-in: a ``Location`` then points where the
  tool asked, and following it gets the value put in again;
- in the body, each value becomes as many ``*``: the length stays, so ``Content-Length``
  and chunk sizes stay true. A value cut by a chunk's framing, compressed or encoded
  otherwise is not seen (docs/security.md, "What it does not stop").

The answer streams: the body is held back only by the longest form a value can take. Most
data is passed after a plain substring search for each value's longest run of letters and
digits, which no encoder escapes; the pattern runs only where one is found.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

from sandboxd.egress.http1 import MAX_HEAD_BYTES, Malformed
from sandboxd.rules.secrets import Secret

_INTERIM = re.compile(rb"^HTTP/\d\.\d 1\d\d\b")  # a 100 Continue, say: another head follows it
_ALNUM_RUN = re.compile(r"[A-Za-z0-9]{4,}")


def _value_pattern(value: str) -> bytes:
    """``value`` with each character as it is or percent-encoded (either hex case; a space also ``+``)."""
    parts = []
    for char in value.encode():
        hexes = "".join(f"[{d}{d.lower()}]" if d.isalpha() else d for d in f"{char:02X}")
        literal = re.escape(bytes([char])).decode("latin-1")
        parts.append(f"(?:{literal}|%{hexes}{'|[+]' if char == 0x20 else ''})")
    return "".join(parts).encode("latin-1")


class AnswerScrubber:
    """Feed it an origin's answer as it arrives; it returns what the sandbox may get (``end`` the rest)."""

    def __init__(self, secrets: Iterable[Secret]) -> None:
        own = sorted(secrets, key=lambda s: -len(s.value))  # the longest first: a value inside another
        if not own:
            raise ValueError("an answer is scrubbed of a call's secrets: name at least one")
        self._stand_ins = {f"s{i}": s.stand_in.encode() for i, s in enumerate(own)}
        self._names = {f"s{i}": s.name for i, s in enumerate(own)}
        self._pattern = re.compile(b"|".join(b"(?P<s%d>%s)" % (i, _value_pattern(s.value)) for i, s in enumerate(own)))
        self._hold = max(len(s.value.encode()) for s in own) * 3 - 1  # the longest form, cut at the data's end
        runs = [max(_ALNUM_RUN.findall(s.value), key=len, default="").encode() for s in own]
        self._anchors = tuple(runs) if all(runs) else None  # None: a value without one, every byte is searched
        self._pending = b""
        self._in_head = True
        self._status = b""  # the status line of the head being read
        self.found: set[str] = set()  # the names of the values that came back

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        out = self._head() if self._in_head else b""
        if not self._in_head:
            out += self._body(final=False)
        return out

    def end(self) -> bytes:
        """What is still held back, at the answer's end."""
        if self._in_head:  # a head cut short: what came of it scrubbed as a head's
            rest, self._pending = self._pending, b""
            return self._sub(self._stand_in, rest)
        return self._body(final=True)

    def _head(self) -> bytes:
        """The head's complete lines, each scrubbed; after the blank line that ends a final head, the body."""
        out = []
        while self._in_head:
            end = self._pending.find(b"\n")
            if end < 0:
                if len(self._pending) > MAX_HEAD_BYTES:
                    raise Malformed(f"a line of the answer's head is longer than {MAX_HEAD_BYTES} bytes")
                break
            line, self._pending = self._pending[:end + 1], self._pending[end + 1:]
            out.append(self._sub(self._stand_in, line))
            if line in (b"\r\n", b"\n"):
                self._in_head = _INTERIM.match(self._status) is not None
                self._status = b""
            elif not self._status:
                self._status = line
        return b"".join(out)

    def _body(self, final: bool) -> bytes:
        body = self._sub(self._masked, self._pending)
        keep = 0 if final else min(self._hold, len(body))
        self._pending = body[len(body) - keep:]
        return body[:len(body) - keep]

    def _sub(self, replace: Callable[[re.Match[bytes]], bytes], data: bytes) -> bytes:
        if self._anchors is not None and not any(anchor in data for anchor in self._anchors):
            return data  # no value can be in it: a substring search, ten times the pattern's speed
        return self._pattern.sub(replace, data)

    def _stand_in(self, match: re.Match[bytes]) -> bytes:
        assert match.lastgroup is not None
        self.found.add(self._names[match.lastgroup])
        return self._stand_ins[match.lastgroup]

    def _masked(self, match: re.Match[bytes]) -> bytes:
        assert match.lastgroup is not None
        self.found.add(self._names[match.lastgroup])
        return b"*" * len(match.group(0))
