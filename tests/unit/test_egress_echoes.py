"""An answer from a secret's host as the sandbox gets it (egress/echoes.py): values in the head become the
stand-in, values in the body stars of the same length, however the answer is cut into reads."""

from __future__ import annotations

import pytest

from sandboxd.egress.echoes import AnswerScrubber
from sandboxd.egress.http1 import MAX_HEAD_BYTES, Malformed
from sandboxd.rules.secrets import StandIns

VALUE = "tok en/with+odd=chars"
ENCODED = "tok%20en%2Fwith%2Bodd%3Dchars"


def scrubbed(answer: bytes, step: int) -> tuple[bytes, set[str], str]:
    env, found = StandIns.for_call({"T": VALUE, "U": "other-value"}, {"T": ["a.test"], "U": ["a.test"]})
    scrubber = AnswerScrubber(found.secrets)
    out = b"".join(scrubber.feed(answer[i:i + step]) for i in range(0, len(answer), step)) + scrubber.end()
    return out, scrubber.found, env["T"]


@pytest.mark.parametrize("step", [1, 2, 7, 64, 1 << 16])
def test_values_in_heads_become_the_stand_in_and_in_the_body_stars(step: int) -> None:
    mixed = "tok+en%2fwith%2Bodd%3dchars"  # a form's space, lower-case hex
    body = f"<a href='/?t={ENCODED}'>{VALUE}</a> {mixed}".encode()
    answer = (b"HTTP/1.1 100 Continue\r\nX-Echo: " + VALUE.encode() + b"\r\n\r\n"
              b"HTTP/1.1 301 Moved\r\nLocation: https://a.test/?t=" + ENCODED.encode() + b"\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    out, found, stand_in = scrubbed(answer, step)
    head, _, rest = out.rpartition(b"\r\n\r\n")
    assert f"X-Echo: {stand_in}\r\n".encode() in head and f"Location: https://a.test/?t={stand_in}".encode() in head
    assert len(rest) == len(body) and b"tok" not in rest and rest.count(b"*") == len(ENCODED + VALUE + mixed)
    assert found == {"T"}


def test_an_answer_without_values_passes_unchanged_and_a_partial_value_at_the_end_is_kept() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\nok tok en/wi"
    out, found, _ = scrubbed(answer, 5)
    assert out == answer and found == set()


def test_a_head_line_without_end_is_refused() -> None:
    _, found = StandIns.for_call({"T": VALUE}, {"T": ["a.test"]})
    scrubber = AnswerScrubber(found.secrets)
    with pytest.raises(Malformed, match="longer than"):
        scrubber.feed(b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD_BYTES)
