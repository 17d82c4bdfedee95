"""JSON as RFC 8259 defines it: UTF-8, no NaN, no Infinity, no number that overflows to one.

Python's json module reads all three and writes them back out, which no other
JSON parser accepts (a client would choke on ``"id":NaN``), and a NaN deadline
breaks every comparison made with it. Whatever a client or a sandbox sends is
read through ``loads``; a ValueError means "not JSON". ``loads(..., unique_keys=True)``
also refuses an object with the same key twice (DuplicateKey, still a ValueError):
parsers disagree on which value wins, so a proxy in front could be fooled.

``dumps_line`` writes one message as a line of compact UTF-8 JSON, with orjson: a
tenth of the stdlib's CPU, and every message out of the daemon is one. ``loads_line``
reads one the same way where duplicate keys need no check (a sandbox's lines, the
daemon's answers to a client).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import orjson


# The largest integer a double holds: a larger one is Infinity to a JavaScript client, so no
# client could match an id or a progress token of that size.
MAX_DOUBLE_INT = int(sys.float_info.max)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is too large")
    return value


class DuplicateKey(ValueError):
    """An object holds the same key twice."""


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        raise DuplicateKey(f"the key {json.dumps(duplicate[:60], ensure_ascii=False)} appears twice in one object")
    return obj


# Made once: json.loads with any option builds a new decoder per call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
_UNIQUE_KEYS_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float,
                                        object_pairs_hook=_unique_object)


# orjson reads JSON as the stdlib reads it (tests/unit/test_hot_path.py holds it to that) at a quarter of
# its CPU, but for what ``_as_stdlib_reads`` looks for: there the stdlib's answer (or its refusal's words) is kept.
_DIGIT_TO_HASH = bytes.maketrans(b"0123456789", b"##########")
_NINETEEN_DIGITS = b"#" * 19  # an integer of 19 digits may be past 64 bits


def _as_stdlib_reads(data: bytes, written: bytes, unique_keys: bool) -> bool:
    """Whether the stdlib reads ``data`` as orjson did, given orjson's reading written back out (``written``).
    ``find``, not ``in``: ``needle in data`` first tries the needle as an int, raising and clearing a TypeError."""
    if data.translate(_DIGIT_TO_HASH).find(_NINETEEN_DIGITS) >= 0:
        return False  # an integer past 64 bits, which orjson makes a float: the stdlib keeps it exact
    # Where a key came twice, orjson kept the last pair and dropped the other, key and all: written back
    # out, the value has fewer '"' than ``data`` (a '"' is written as \", so only \u0022 could hide that).
    return not unique_keys or (data.count(b'"') == written.count(b'"') and data.find(b"\\u0022") < 0)


def loads(data: str | bytes, *, unique_keys: bool = False) -> Any:
    if isinstance(data, bytes):
        try:
            value = orjson.loads(data)
            # Refuses nesting past 254 (orjson reads 1024), short of where the stdlib's recursion limit may.
            written = orjson.dumps(value)
        except (orjson.JSONDecodeError, orjson.JSONEncodeError):
            pass  # the stdlib's refusal, in its words (or its reading, of a lone surrogate orjson refuses)
        else:
            if _as_stdlib_reads(data, written, unique_keys):
                return value
        # json.loads would decode bytes with "surrogatepass", letting UTF-8-encoded
        # surrogates (not UTF-8) through; this raises UnicodeDecodeError instead.
        data = data.decode("utf-8")
    if data.startswith("\ufeff"):  # what json.loads refuses and JSONDecoder.decode would not
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", data, 0)
    return (_UNIQUE_KEYS_DECODER if unique_keys else _DECODER).decode(data)


_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"))


def dumps_line(message: Any) -> bytes:
    """``message`` as compact JSON and a newline. What orjson refuses (a lone surrogate from a
    tool's output, an integer past 64 bits) is written by the stdlib, every non-ASCII escaped."""
    try:
        return orjson.dumps(message, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return _ASCII_ENCODER.encode(message).encode() + b"\n"


def loads_line(line: bytes) -> Any:
    """A line as JSON, by orjson: a quarter of ``loads``'s CPU. orjson refuses all ``loads`` refuses
    (NaN, Infinity, a number that overflows, a BOM, invalid UTF-8, deep nesting); what it alone
    refuses (an escaped lone surrogate) gets ``loads``'s verdict. Duplicate keys: the last wins."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return loads(line)
