"""JSON as RFC 8259 defines it: UTF-8, no NaN, no Infinity, no number that overflows to one.

Python's json module reads all three and writes them back out, which no other
JSON parser accepts (a client would choke on ``"id":NaN``), and a NaN deadline
breaks every comparison made with it. Whatever a client or a sandbox sends is
read through ``loads``; a ValueError means "not JSON".
"""

from __future__ import annotations

import json
import math
from typing import Any


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is too large")
    return value


def loads(data: str | bytes) -> Any:
    if isinstance(data, bytes):
        # json.loads would decode bytes with "surrogatepass", letting UTF-8-encoded
        # surrogates (not UTF-8) through; this raises UnicodeDecodeError instead.
        data = data.decode("utf-8")
    return json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float)
