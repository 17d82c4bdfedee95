"""egress/http1.py: what the proxy's parser takes, what it refuses, and what it hands on to be forwarded.

The end-to-end counterpart, against three real servers, is tests/e2e/test_egress_smuggling.py.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from sandboxd.egress.grants import GRANT_ENDED, CallGrant
from sandboxd.egress.http1 import MAX_HEAD_BYTES, Malformed, RequestReader
from sandboxd.egress.request import parse_request as _parse

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: vm\r\nX-Key: k\r\n\r\n"


def read(data: bytes, *, pieces: int = 1) -> RequestReader:
    """``data`` fed in ``pieces`` roughly equal parts (a parser must not care where reads split)."""
    reader = RequestReader()
    size = max(1, -(-len(data) // pieces))
    for at in range(0, len(data), size):
        reader.feed(data[at:at + size])
    return reader


@pytest.mark.parametrize(("request_bytes", "problem"), [
    (b"GET http://a/legit HTTP/1.1\r\nX-A: x\n\n" + SMUGGLED, "Missing expected CR"),  # issue 36's payload
    (b"GET http://a/ HTTP/1.1\nHost: a\n\n", "Expected CRLF"),
    (b"GET http://a/ HTTP/1.1\r\nX-A: x\rY: z\r\n\r\n", "Missing expected LF"),
    (b"GET http://a/ HTTP/1.1\r\nX-A: x\x00y\r\n\r\n", "Invalid header value char"),
    (b"GET http://a/ HTTP/1.1\r\nX\x00A: y\r\n\r\n", "Invalid header token"),
    (b"GET http://a/ HTTP/1.1\r\nX-A: x\x0by\r\n\r\n", "Invalid header value char"),
    (b"GET http://a/ HTTP/1.1\r\nX-A: x\r\n folded\r\n\r\n", "whitespace"),
    (b"GET http://a/ HTTP/1.1\r\nX-A : x\r\n\r\n", "Invalid header token"),
    (b"POST http://a/ HTTP/1.1\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "Content-Length"),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n", "Content-Length"),
    (b"POST http://a/ HTTP/1.1\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcde", "Duplicate Content-Length"),
    (b"POST http://a/ HTTP/1.1\r\nContent-Length: 4\r\nContent-Length: 4\r\n\r\nabcd", "Duplicate Content-Length"),
    (b"POST http://a/ HTTP/1.1\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n0\r\n\r\n", "only exactly 'chunked'"),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: chunked \r\n\r\n0\r\n\r\n", "only exactly 'chunked'"),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: chunked\t\r\n\r\n0\r\n\r\n", "only exactly 'chunked'"),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", "Transfer-Encoding"),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", "Transfer-Encoding"),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     "Transfer-Encoding"),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n", "chunk size"),
    (b"GET http://a/ HTTP/2.0\r\n\r\n", "HTTP/2.0"),
    (b"GET http://a/ HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", "through CONNECT"),
    (b"GET http://a/\xff HTTP/1.1\r\n\r\n", "Invalid char in url"),
    (b"GET http://a/ HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", f"exceeds {MAX_HEAD_BYTES} bytes"),
])
@pytest.mark.parametrize("pieces", [1, 7])
def test_what_could_be_read_two_ways_is_refused(request_bytes: bytes, problem: str, pieces: int) -> None:
    with pytest.raises(Malformed, match=problem.replace("(", r"\(")):
        read(request_bytes, pieces=pieces)


@pytest.mark.parametrize("pieces", [1, 5, 1000])
def test_a_second_request_after_the_first_is_extra_never_part_of_it(pieces: int) -> None:
    for first in (b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
                  b"POST http://a/ HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi",
                  b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"):
        reader = read(first + SMUGGLED, pieces=pieces)
        assert reader.complete and reader.extra
        assert reader.head is not None and [name for name, _ in reader.head.headers].count(b"Host") <= 1
        assert b"smuggled" not in reader.take_body()
    garbage = read(b"GET http://a/ HTTP/1.1\r\n\r\n\x00\x01garbage")
    assert garbage.complete and garbage.extra


def test_bodies_are_handed_on_as_framed_and_chunked_ones_framed_again() -> None:
    plain = read(b"POST http://a/p HTTP/1.1\r\nContent-Length: 11\r\n\r\nhello world", pieces=9)
    assert plain.complete and not plain.extra and plain.take_body() == b"hello world"
    reader = read(b"POST http://a/p HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"5;ext=\"x\"\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n", pieces=4)
    assert reader.complete and reader.head is not None and reader.head.chunked
    body = reader.take_body()
    assert body.endswith(b"0\r\n\r\n") and b"ext" not in body and b"Trailer" not in body
    assert read(b"POST http://a/p HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + body).take_body() == body
    assert [name for name, _ in reader.head.headers] == [b"Transfer-Encoding"]  # the trailer is dropped


def test_a_connect_heads_early_bytes_are_the_tunnels() -> None:
    hello = b"\x16\x03\x01\x00\x05hello"
    reader = read(b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n" + hello)
    assert reader.complete and not reader.extra and reader.early == hello
    assert reader.head is not None and (reader.head.method, reader.head.target) == ("CONNECT", "a.test:443")


def test_the_forwarded_head_is_written_from_what_was_parsed() -> None:
    reader = read(b"POST http://a.test:8080/p?q=1 HTTP/1.1\r\nHost: evil.test\r\nX-A:   spaced  \r\n"
                  b"Proxy-Connection: keep-alive\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nhi")
    assert reader.head is not None
    method, scheme, host, port, forward = _parse(reader.head)
    assert (method, scheme, host, port) == ("POST", "http", "a.test", 8080)
    assert forward == (b"POST /p?q=1 HTTP/1.1\r\nHost: a.test:8080\r\nX-A: spaced\r\nContent-Length: 2\r\n"
                       b"Connection: close\r\n\r\n")


def test_a_grant_ends_the_connections_held_under_it_and_admits_none_after() -> None:
    async def scenario() -> tuple[bool, bool, bool]:
        grant = CallGrant()
        held = asyncio.ensure_future(asyncio.sleep(60))
        admitted = grant.hold(held)  # type: ignore[arg-type]
        grant.end()
        await asyncio.gather(held, return_exceptions=True)
        return admitted, held.cancelled(), grant.hold(asyncio.ensure_future(asyncio.sleep(0)))  # type: ignore[arg-type]

    assert asyncio.run(scenario()) == (True, True, False)
    assert "answered" in GRANT_ENDED


def test_the_proxy_forwards_nothing_after_the_request_even_when_it_comes_later() -> None:
    """Over a socketpair to a real upstream socket: the request, then (after the head went out) a second
    one on the same connection; the upstream receives the first only, then the proxy's end of it."""
    from sandboxd.config import EgressConfig
    from sandboxd.egress.proxy import EgressProxy
    from sandboxd.rules.secrets import StandIns
    from sandboxd.egress.contract import EgressCall

    async def scenario() -> tuple[bytes, bytes]:
        received = bytearray()
        got_head = asyncio.Event()

        async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while chunk := await r.read(65536):
                received.extend(chunk)
                if b"\r\n\r\n" in received:
                    got_head.set()
                if received.endswith(b"hi"):
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                    await w.drain()
                    w.close()
                    return

        server = await asyncio.start_server(upstream, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        async def resolve(_host: str, _port: int) -> list[Any]:
            raise OSError("no lookups here")

        proxy = EgressProxy(EgressConfig(allow=[f"127.0.0.1:{port}"]), resolve=resolve)
        session = proxy.session("a@b.c", "s", lambda: EgressCall(None, frozenset(), StandIns()))
        ours, theirs = socket.socketpair()
        task = asyncio.ensure_future(session.handle(theirs))
        r, w = await asyncio.open_connection(sock=ours)
        w.write(f"POST http://127.0.0.1:{port}/p HTTP/1.1\r\nContent-Length: 2\r\n\r\n".encode())
        await w.drain()
        await asyncio.wait_for(got_head.wait(), 5)
        w.write(b"hi" + SMUGGLED)
        await w.drain()
        answer = await asyncio.wait_for(r.read(), 10)
        w.close()
        await asyncio.wait_for(task, 10)
        server.close()
        proxy.close()
        return bytes(received), answer

    received, answer = asyncio.run(scenario())
    assert received.endswith(b"Connection: close\r\n\r\nhi") and b"smuggled" not in received, received
    assert answer.endswith(b"ok"), answer


def test_a_request_whose_call_was_answered_gets_no_value_and_reaches_nothing() -> None:
    """The call ended between the proxy's look at it and the connect: its grant admits nothing more, so a
    request that would carry its secret is refused (403) before a byte goes to the host."""
    from sandboxd.config import EgressConfig
    from sandboxd.egress.proxy import EgressProxy
    from sandboxd.rules.secrets import StandIns
    from sandboxd.egress.contract import EgressCall

    async def scenario() -> tuple[bytes, bytes]:
        received = bytearray()

        async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            received.extend(await r.read(65536))
            w.close()

        server = await asyncio.start_server(upstream, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        env, stand_ins = StandIns.for_call({"T": "real-value"}, {"T": [f"http://127.0.0.1:{port}"]})
        grant = CallGrant()
        grant.end()
        proxy = EgressProxy(EgressConfig(allow=[f"127.0.0.1:{port}"]))
        session = proxy.session("a@b.c", "s", lambda: EgressCall("t", frozenset(), stand_ins, None, grant))
        ours, theirs = socket.socketpair()
        task = asyncio.ensure_future(session.handle(theirs))
        r, w = await asyncio.open_connection(sock=ours)
        w.write(f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nX-Key: {env['T']}\r\n\r\n".encode())
        answer = await asyncio.wait_for(r.read(), 10)
        w.close()
        await asyncio.wait_for(task, 10)
        await asyncio.sleep(0.1)
        server.close()
        proxy.close()
        return bytes(received), answer

    received, answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 403") and GRANT_ENDED.encode() in answer, answer
    assert b"real-value" not in received and received == b"", received
