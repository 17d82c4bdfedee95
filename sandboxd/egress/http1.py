"""A sandbox's request, read by llhttp (Node's HTTP parser, through httptools) in its strict mode.

The proxy forwards only what this module understood: a request line, headers, and a body
framed by one Content-Length or by chunked transfer coding. llhttp refuses a bare CR or LF,
NUL and other control characters, obs-fold, whitespace before a colon, Content-Length with
Transfer-Encoding, and two Content-Lengths; on top of it, Transfer-Encoding must be exactly
``chunked``, once (``Chunked``, ``chunked ``, ``chunked, identity`` are refused: another
parser may read them otherwise). A request is one message: bytes after its end are never
part of it (``extra``). Why llhttp and not h11: h11 takes bare LF line ends and obs-fold
(which another server may read as two requests), and parsing a typical head took 43 µs
in h11 against 9-12 µs here (bench/egress_http.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import httptools

MAX_HEAD_BYTES = 16 << 10


class Malformed(ValueError):
    """Not a request the proxy forwards; the message says what is wrong (the sandbox's bytes, cut short)."""


class _Stop(Exception):
    """Raised in a callback to stop llhttp where the request ends."""


@dataclass(frozen=True)
class Head:
    """A request head as llhttp read it: header values without the whitespace around them."""

    method: str
    target: str
    headers: tuple[tuple[bytes, bytes], ...]  # trailers (after a chunked body) are not here: they are dropped
    chunked: bool
    length: int  # Content-Length (0 without one); meaningless when chunked

    def has_body(self) -> bool:
        return self.chunked or self.length > 0


class RequestReader:
    """Feed it what the sandbox sends; ``head`` once the head is read, then ``take_body`` the body as
    the proxy forwards it (chunked bodies framed again by the proxy, without extensions or trailers)
    until ``complete``. ``early`` is what followed a CONNECT head (a TLS hello: the tunnel's);
    ``extra`` says bytes followed the request's end (never forwarded). ``feed`` raises Malformed."""

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._url = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._body = bytearray()
        self._head_bytes = 0
        self._messages = 0
        self.head: Head | None = None
        self.complete = False
        self.early = b""
        self.extra = False

    # llhttp's callbacks (httptools calls them by name).
    def on_message_begin(self) -> None:
        self._messages += 1
        if self._messages > 1:  # a second request on the same bytes: one per connection
            self.extra = True
            raise _Stop

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head is None:  # after the head: a chunked body's trailers, dropped
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.head = self._make_head()

    def on_body(self, body: bytes) -> None:
        assert self.head is not None
        if self.head.chunked:  # each piece a chunk of its own: the framing is the proxy's, not the sandbox's
            self._body += b"%x\r\n" % len(body) + body + b"\r\n"
        else:
            self._body += body

    def on_message_complete(self) -> None:
        assert self.head is not None
        if self.head.chunked:
            self._body += b"0\r\n\r\n"
        self.complete = True

    def feed(self, data: bytes) -> None:
        if self.complete:
            self.extra = self.extra or bool(data)
            return
        room = MAX_HEAD_BYTES - self._head_bytes
        if self.head is None and len(data) > room:  # the head must end within MAX_HEAD_BYTES: feed that much first
            self._feed(data[:room])
            if self.head is None:
                raise Malformed(f"the request head exceeds {MAX_HEAD_BYTES} bytes")
            self._feed(data[room:])
        else:
            self._feed(data)

    def _feed(self, data: bytes) -> None:
        if self.complete:
            self.extra = self.extra or bool(data)
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            if self.head is None or self.head.method != "CONNECT":
                raise Malformed("an Upgrade in an absolute-form request is not forwarded; open a WebSocket "
                                "(or anything else that upgrades) through CONNECT") from None
            self.early = data[upgrade.args[0]:]  # the tunnel's first bytes: not HTTP, not parsed
            self.complete = True
            return
        except httptools.HttpParserCallbackError as error:
            cause = error.__context__
            if isinstance(cause, Malformed):
                raise cause from None
            if not isinstance(cause, _Stop):
                raise
            return
        except httptools.HttpParserError as error:
            if self.complete:  # what follows the request does not parse: still bytes after its end
                self.extra = True
                return
            raise Malformed(f"not a request the proxy can read one way only: {error} (llhttp, strict); send "
                            "HTTP/1.1 with CRLF line ends, no control characters and one framing") from None
        if self.head is None:
            self._head_bytes += len(data)

    def take_body(self) -> bytes:
        """The body's bytes read since the last call, framed as they are to be forwarded."""
        body = bytes(self._body)
        self._body.clear()
        return body

    def _make_head(self) -> Head:
        version = self._parser.get_http_version()
        if version not in ("1.0", "1.1"):
            raise Malformed(f"HTTP/{version} is not HTTP/1.0 or HTTP/1.1")
        lengths = [value for name, value in self._headers if name.lower() == b"content-length"]
        codings = [value for name, value in self._headers if name.lower() == b"transfer-encoding"]
        # llhttp refuses these already; checked again here since what is forwarded depends on them.
        if len(lengths) > 1 or (lengths and codings):
            raise Malformed("a request may carry one Content-Length, or Transfer-Encoding, not both or two")
        if codings and codings != [b"chunked"]:
            raise Malformed(f"Transfer-Encoding {b', '.join(codings)[:80]!r}: only exactly 'chunked' is forwarded "
                            "(another server could read another spelling otherwise)")
        if lengths and not lengths[0].isdigit():
            raise Malformed(f"Content-Length {lengths[0][:40]!r} is not a number")
        try:
            target = self._url.decode("ascii")
        except UnicodeDecodeError:
            raise Malformed(f"the request target {bytes(self._url[:200])!r} is not ASCII; percent-encode it") from None
        return Head(method=self._parser.get_method().decode("ascii"), target=target,
                    headers=tuple((name, value.strip(b" \t")) for name, value in self._headers),
                    chunked=bool(codings), length=int(lengths[0]) if lengths else 0)
