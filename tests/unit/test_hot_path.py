"""What the warm call's cheaper steps must still do: the answer's encoder, the per-call metrics,
the generated toolCallId (issue 37 made each of them cheaper; these keep them right)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from sandboxd import strictjson
from sandboxd.sandbox.backend import container_entry_path
from sandboxd.server.calls import params
from sandboxd.service.metrics import CALL_SECONDS_BUCKETS, CallStats
from sandboxd.tools.manifest import Manifest
from sandboxd.tools.tool import Tool


def test_an_answer_is_one_line_of_compact_utf8_json() -> None:
    line = strictjson.dumps_line({"id": 1, "text": "héllo\nworld\u2028", "n": None, "ok": True, "f": 1.5})
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # a newline in a string is escaped
    assert line == '{"id":1,"text":"héllo\\nworld\u2028","n":null,"ok":true,"f":1.5}\n'.encode()


def test_what_orjson_refuses_still_goes_out_escaped() -> None:
    # A lone surrogate (a tool's broken output) and an integer past 64 bits: the stdlib writes them.
    line = strictjson.dumps_line({"text": "a\ud800b", "big": 2**70, "é": "é"})
    assert line == b'{"text":"a\\ud800b","big":1180591620717411303424,"\\u00e9":"\\u00e9"}\n'
    assert json.loads(line)["big"] == 2**70


def _stdlib_reading(data: bytes, unique_keys: bool) -> tuple[str, str]:
    """What strictjson.loads answered before orjson read for it: the stdlib's value (repr, so 1 != 1.0), or its error."""
    decoder = strictjson._UNIQUE_KEYS_DECODER if unique_keys else strictjson._DECODER
    try:
        text = data.decode("utf-8")
        if text.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        return "value", repr(decoder.decode(text))
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__, str(exc)


def _reading(data: bytes, unique_keys: bool) -> tuple[str, str]:
    try:
        return "value", repr(strictjson.loads(data, unique_keys=unique_keys))
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("data", [
    b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"user":"a@b.c","arguments":{"x":[1.5,-0.0,null]}}}',
    b'{"a":1,"a":2}', b'{"a":{"b":1,"b":2}}', b'[{"k":"\"","k":"\""}]',  # a duplicate key, refused
    b'{"a":1,"a":"\\u0022\\u0022"}',  # a duplicate whose dropped '"' the kept value spells as \u0022
    b'{"id":18446744073709551616}', b'[-9223372036854775809,1234567890123456789]',  # past 64 bits: kept exact
    b"[" * 255 + b"]" * 255, b"[" * 5000 + b"]" * 5000,  # deep, and deeper than the stdlib reads
    b'"\\ud800"', b'"\\u00e9\\/"', b"\xef\xbb\xbf{}", b'"\xed\xa0\x80"', b'"\x01"', b"1e400", b"NaN", b"[1,]", b" 5e-324 ",
])
def test_requests_are_read_as_the_stdlib_reads_them(data: bytes) -> None:
    # orjson reads them (a quarter of the CPU) where it gives the stdlib's answer; else the stdlib, in its words.
    for unique_keys in (True, False):
        assert _reading(data, unique_keys) == _stdlib_reading(data, unique_keys)


def test_call_stats_render_the_same_series_as_prometheus_histograms() -> None:
    stats = CallStats()
    registry = CollectorRegistry()
    registry.register(stats)
    stats.observe("hello", "ok", 0.005, 0.0)  # on a bound: counted in that bucket (le)
    stats.observe("hello", "ok", 0.007, None)  # no queue wait observed
    stats.observe("hello", "error", 1000.0, 0.002)  # above every bound: +Inf only
    text = generate_latest(registry).decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values['sandboxd_calls_total{status="ok",tool="hello"}'] == 2
    assert values['sandboxd_calls_total{status="error",tool="hello"}'] == 1
    assert values['sandboxd_call_duration_seconds_bucket{le="0.005",tool="hello"}'] == 1
    assert values['sandboxd_call_duration_seconds_bucket{le="0.01",tool="hello"}'] == 2
    assert values[f'sandboxd_call_duration_seconds_bucket{{le="{float(CALL_SECONDS_BUCKETS[-1])}",tool="hello"}}'] == 2
    assert values['sandboxd_call_duration_seconds_bucket{le="+Inf",tool="hello"}'] == 3
    assert values['sandboxd_call_duration_seconds_count{tool="hello"}'] == 3
    assert abs(values['sandboxd_call_duration_seconds_sum{tool="hello"}'] - 1000.012) < 1e-9
    assert values["sandboxd_queue_wait_seconds_count"] == 2
    assert values['sandboxd_queue_wait_seconds_bucket{le="0.001"}'] == 1


def test_generated_tool_call_ids_are_unique_and_look_like_call_hex() -> None:
    ids = [next(params._GENERATED_IDS) for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(re.fullmatch(r"call_[0-9a-f]{16,}", i) for i in ids)
    assert len({i[:13] for i in ids}) == 1  # one random prefix per daemon, not a read of the kernel's per call


def test_an_entry_path_in_the_sandbox_is_where_docs_tools_md_mounts_its_tool() -> None:
    manifest = Manifest(name="hello", label="Hello", description="D.", version=1, language="typescript",
                        inputs=(), body="", path=Path("TOOL.md"))  # not read: the path is the folder's and entry's
    folder = Path("/var/lib/sandboxd/alice@example.com/tools/hello.v2")
    assert container_entry_path(Tool(manifest, folder, folder / "index.ts", "user")) == "/officer/user/tools/hello.v2/index.ts"
    folder = Path("/var/lib/sandboxd/tools/hello")
    assert container_entry_path(Tool(manifest, folder, folder / "index.js", "global")) == "/officer/tools/hello/index.js"
