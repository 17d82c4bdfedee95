"""The one line splitter of the daemon's socket, the shim channel and the client."""

from __future__ import annotations

from sandboxd.lines import TOO_LONG, LineBuffer


def feed_all(buffer: LineBuffer, *chunks: bytes) -> list[object]:
    return [line for chunk in chunks for line in buffer.feed(chunk)]


def test_lines_split_on_newline_only_across_chunks() -> None:
    buffer = LineBuffer(100)
    assert feed_all(buffer, b'{"a":"x\xe2\x80\xa8y"}\n{"b"', b':1}\r\n\n\r\n', b"tail") == [
        b'{"a":"x\xe2\x80\xa8y"}', b'{"b":1}']
    assert feed_all(buffer, b"\n") == [b"tail"]


def test_an_over_long_line_comes_out_once_in_order_and_is_skipped() -> None:
    buffer = LineBuffer(8)
    # Whole in one chunk.
    assert feed_all(buffer, b"ok\n" + b"x" * 9 + b"\nafter\n") == [b"ok", TOO_LONG, b"after"]
    # Spread over chunks: said once, as soon as it passes the limit, and never held.
    assert feed_all(buffer, b"y" * 9) == [TOO_LONG]
    assert feed_all(buffer, b"y" * 100_000) == []
    assert len(buffer._buffer) == 0
    assert feed_all(buffer, b"yyy\nnext\n") == [b"next"]


def test_a_line_at_the_limit_passes() -> None:
    buffer = LineBuffer(8)
    assert feed_all(buffer, b"x" * 8 + b"\n", b"y" * 8, b"\n") == [b"x" * 8, b"y" * 8]


def test_what_a_reader_that_stops_early_leaves_comes_next_time() -> None:
    buffer = LineBuffer(8)
    for line in buffer.feed(b"one\ntwo\n"):
        assert line == b"one"
        break
    assert feed_all(buffer, b"") == [b"two"]


def test_no_limit() -> None:
    assert feed_all(LineBuffer(), b"z" * 1_000_000 + b"\n") == [b"z" * 1_000_000]
