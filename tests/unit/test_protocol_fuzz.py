"""Property-based abuse of the real server (fake backend): whatever bytes arrive,
the daemon answers each line as JSON-RPC says, never with an internal error, never
with something that is not JSON, and keeps the connection and itself alive.

The server runs in a thread with its own event loop for the whole module; every
hypothesis example talks to it over a fresh unix-socket connection, so the
examples exercise the same code path a client does (framing included).
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxd import strictjson
from sandboxd.config import load_config
from sandboxd.sandbox.backend import CallRequest
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.server.server import Server

USER = "alice@example.com"
MAX_LINE = 4096  # small, so that examples can cross the limit cheaply
INTERNAL_ERROR = -32603


def _tools(data: Path) -> None:
    for name, inputs in {
        "hello": "  name:\n    type: string\n    description: Who.\n"
                 "  token:\n    type: string\n    description: A secret.\n    optional: true\n    sensitive: true\n",
        "calc": "  n:\n    type: number\n    description: A number.\n"
                "  flag:\n    type: boolean\n    description: A flag.\n    optional: true\n"
                "  mode:\n    type: enum\n    values: [a, b]\n    description: A mode.\n    optional: true\n",
    }.items():
        tool = data / "tools" / name
        tool.mkdir(parents=True)
        (tool / "TOOL.md").write_text(f"---\nname: {name}\ndescription: Fuzz target {name}.\nversion: 1\ninputs:\n{inputs}---\n# {name}\n")
        (tool / "index.ts").write_text("export async function execute() {}\n")


async def _handler(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
    on_progress([{"type": "text", "text": "working"}])
    try:
        await asyncio.wait_for(aborted.wait(), 0.005)
    except TimeoutError:
        pass
    return {"status": "ok", "content": [{"type": "text", "text": "done"}], "isError": False}


class ThreadedServer:
    """The real Server on a fake backend, serving from a background event loop."""

    def __init__(self, tmp: Path) -> None:
        _tools(tmp / "data")
        self.config = load_config(overrides={
            "data_path": tmp / "data", "socket": tmp / "s.sock", "seed_tools": None, "backend": "fake",
            "max_message_bytes": MAX_LINE, "log_level": "warning",
        }, environ={})
        self.backend = FakeBackend(_handler)
        self.loop = asyncio.new_event_loop()
        self.server: Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self.server = Server(self.config, self.backend)
        await self.server.startup()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        assert self.server is not None
        self.run(self.server.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def connect(self) -> socket.socket:
        for _ in range(500):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            try:
                sock.connect(str(self.config.socket))
                return sock
            except BlockingIOError:  # the listen backlog is full: a unix socket says so at once
                sock.close()
                time.sleep(0.01)
        raise AssertionError("the daemon stopped accepting connections")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    server = ThreadedServer(tmp_path_factory.mktemp("fuzz"))
    yield server
    assert server.server is not None
    assert not server.server.calls.in_flight, "calls left in flight"
    assert server.backend.calls_to_dead == 0
    server.stop()


# -- reading answers -----------------------------------------------------------------


def _strict(line: bytes) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"the daemon wrote {name}, which is not JSON: {line[:200]!r}")

    return json.loads(line, parse_constant=refuse)


class Reader:
    """Answers from one connection, every line checked; keeps what it read past a sentinel."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.pending: list[dict[str, Any]] = []

    def until(self, sentinel: str) -> list[dict[str, Any]]:
        """Every response up to and including the sentinel ping's."""
        answers: list[dict[str, Any]] = []
        while True:
            while self.pending:
                message = self.pending.pop(0)
                answers.append(message)
                if message.get("id") == sentinel:
                    return answers
            chunk = self.sock.recv(1 << 16)
            assert chunk, f"the daemon closed the connection; answers so far: {answers[-5:]}"
            self.buffer += chunk
            *lines, self.buffer = self.buffer.split(b"\n")
            self.pending.extend(m for m in map(_check_line, lines) if m is not None)

    def answered(self, sentinel: str, expected: int) -> list[dict[str, Any]]:
        """Answers until the sentinel and `expected` others have arrived (calls may answer after it)."""
        answers = [a for a in self.until(sentinel) if a.get("id") != sentinel]
        deadline = time.monotonic() + 10
        while len(answers) < expected:
            assert time.monotonic() < deadline, f"{expected - len(answers)} answers never came; got {answers}"
            time.sleep(0.01)
            self.sock.sendall(b'{"jsonrpc":"2.0","id":"__poll__","method":"ping"}\n')
            answers.extend(a for a in self.until("__poll__") if a.get("id") != "__poll__")
        return answers


def _check_line(line: bytes) -> dict[str, Any] | None:
    """A response (returned) or a progress notification (None); anything else fails the test."""
    message = _strict(line)
    assert isinstance(message, dict) and message.get("jsonrpc") == "2.0", message
    if "method" in message:
        assert message["method"] == "notifications/progress", message
        return None
    assert ("result" in message) != ("error" in message), message
    if "error" in message:
        error = message["error"]
        assert error["code"] != INTERNAL_ERROR, f"internal error for some input: {error}"
        assert isinstance(error["message"], str) and error["message"], error
    return message


# -- the model: how many answers a line gets -------------------------------------------


def _valid_id(value: Any) -> bool:
    return isinstance(value, (str, int, float, type(None))) and not isinstance(value, bool)


def expected_answer(line: bytes) -> tuple[int, Any]:
    """(number of answers, the id the answer carries) per PROTOCOL.md and JSON-RPC 2.0."""
    if len(line) > MAX_LINE:
        return 1, None
    if line.endswith(b"\r"):
        line = line[:-1]
    if not line.strip():
        return 0, None
    try:
        message = json.loads(line, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)),
                             object_pairs_hook=_no_duplicates)
        if any(isinstance(v, float) and v in (float("inf"), float("-inf")) for v in _walk(message)):
            return 1, None
    except (ValueError, RecursionError):  # a duplicate key too: -32600 with id null
        return 1, None
    if not isinstance(message, dict):
        return 1, None
    request_id = message.get("id")
    if not _valid_id(request_id) or isinstance(request_id, int) and abs(request_id) > sys.float_info.max:
        return 1, None
    if message.get("jsonrpc") == "2.0" and isinstance(message.get("method"), str) and "id" not in message:
        return 0, None  # a notification
    return 1, request_id


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError("duplicate key")
    return dict(pairs)


def _walk(value: Any) -> Iterator[Any]:
    stack = [value]
    while stack:
        item = stack.pop()
        yield item
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# -- strategies ------------------------------------------------------------------------

json_leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                          max_leaves=12)
# Ids as JSON-RPC allows them, and as it does not (objects, arrays, booleans, null).
ids = st.one_of(st.integers(-(2**40), 2**40), st.text(max_size=8), st.floats(allow_nan=False, allow_infinity=False),
                st.lists(json_leaf, max_size=3), st.dictionaries(st.text(max_size=4), json_leaf, max_size=3), json_value)
users = st.sampled_from([USER, "bob@example.com", "not-an-email", "../etc@x", "a..b@example.com", "", "x" * 300 + "@e.com"]) | json_leaf
arguments = st.fixed_dictionaries({}, optional={
    "name": st.text(max_size=20) | json_value,
    "token": st.text(max_size=20) | json_value,
    "n": st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(["5", "1e3", "x", ""]) | json_value,
    "flag": st.booleans() | st.sampled_from(["true", "false", "1", "yes"]) | json_value,
    "mode": st.sampled_from(["a", "b", "c"]) | json_value,
    "extra": json_value,
}) | json_value
call_params = st.fixed_dictionaries({"user": users, "name": st.sampled_from(["hello", "calc", "nope"]) | json_leaf}, optional={
    "arguments": arguments,
    "toolCallId": st.text(max_size=300) | json_leaf,
    "env": st.dictionaries(st.sampled_from(["OFFICER_RESOURCES", "HOME", "LD_PRELOAD", "PI_SEARXNG_URL"]), json_leaf, max_size=3) | json_leaf,
    "timeoutMs": st.integers(-5, 10**9) | st.floats(allow_nan=False, allow_infinity=False) | json_leaf,
    "_meta": st.fixed_dictionaries({}, optional={"progressToken": json_value}) | json_leaf,
})
methods = st.sampled_from(["ping", "tools/list", "sandbox/status", "tools/call", "notifications/cancelled", "nope"]) | st.text(max_size=10)


@st.composite
def messages(draw: Any) -> bytes:
    """One line: mostly JSON-RPC shaped, sometimes broken in one or several ways."""
    method = draw(methods)
    message: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        message["jsonrpc"] = "2.0"
    else:
        message["jsonrpc"] = draw(json_leaf)
    if draw(st.integers(0, 9)):
        message["method"] = method
    if draw(st.integers(0, 3)):
        message["id"] = draw(ids)
    if method == "tools/call":
        message["params"] = draw(call_params)
    elif method == "tools/list":
        message["params"] = draw(st.fixed_dictionaries({}, optional={"user": users}) | json_value)
    elif method == "notifications/cancelled":
        message["params"] = draw(st.fixed_dictionaries({"requestId": ids}, optional={"reason": json_leaf}) | json_value)
    elif draw(st.booleans()):
        message["params"] = draw(json_value)
    line = json.dumps(message, separators=(",", ":")).encode()
    return line + draw(st.sampled_from([b"", b"", b"\r"]))


# Notifications get no answer, so a crash while handling one would go unseen but for
# the connection dying: they get their own, denser strategy.
notifications = st.builds(
    lambda method, params: json.dumps({"jsonrpc": "2.0", "method": method, "params": params}).encode(),
    st.sampled_from(["notifications/cancelled", "notifications/progress", "notifications/initialized"]) | st.text(max_size=8),
    st.fixed_dictionaries({"requestId": ids}, optional={"reason": json_value}) | json_value,
)

garbage = st.one_of(
    st.binary(max_size=200).map(lambda b: b.replace(b"\n", b"")),
    st.integers(1, 3000).map(lambda n: b"[" * n),  # deep nesting
    st.integers(1, 3000).map(lambda n: b'{"a":' * n),
    st.binary(min_size=MAX_LINE + 1, max_size=MAX_LINE + 300).map(lambda b: b.replace(b"\n", b"x")),  # over the limit
    st.sampled_from([b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\xff\xfe"}}',  # invalid UTF-8
                     b'{"jsonrpc":"2.0","id":NaN,"method":"ping"}', b'{"jsonrpc":"2.0","id":1e999,"method":"ping"}',
                     b'{"jsonrpc":"2.0","id":"s","method":"ping","params":{"x":"\\ud800"}}', b"\x00" * 10, b"   ", b"\r",
                     b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]', b"{}", b"null", b'"ping"']),
)


# -- hostile request shapes (issue 11), each with the one code it must get -----------------

def _deep(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


_NOT_A_USER = st.one_of(
    st.lists(st.just(USER), min_size=1, max_size=2).map(json.dumps),
    st.just(json.dumps({"email": USER})),
    st.sampled_from([USER + "\n", USER + "\r", " " + USER, USER + "\u0000", "alice@example.com\nbob@example.com"])
    .map(json.dumps),
    st.integers(1, 900).map(_deep),
    st.sampled_from(["1", "true", "1e3"]),
)
_BIG = st.integers(310, 1200).map(lambda digits: "9" * digits)  # past a double, under Python's 4300 digits


@st.composite
def hostile_requests(draw: Any) -> tuple[bytes, int, Any]:
    """(line, the error code it must get, the id that answer carries)."""
    rid = draw(st.integers(1, 10**6))
    head = f'"jsonrpc":"2.0","id":{rid}'
    call = f'"user":"{USER}","name":"calc"'
    kind = draw(st.sampled_from(["list_user", "call_user", "big_arg", "big_id", "big_token", "deep_arg",
                                 "deep_token", "deep_env", "dup_top", "dup_nested"]))
    if kind == "list_user":
        return f'{{{head},"method":"tools/list","params":{{"user":{draw(_NOT_A_USER)}}}}}'.encode(), -32602, rid
    if kind == "call_user":
        return (f'{{{head},"method":"tools/call","params":{{"user":{draw(_NOT_A_USER)},"name":"calc",'
                f'"arguments":{{"n":1}}}}}}').encode(), -32602, rid
    if kind == "big_arg":
        argument = draw(st.sampled_from(["n", "flag", "mode"]))
        sign = draw(st.sampled_from(["", "-"]))
        return (f'{{{head},"method":"tools/call","params":{{{call},"arguments":{{"{argument}":{sign}{draw(_BIG)}}}}}}}'
                .encode(), -32602, rid)
    if kind == "big_id":
        return f'{{"jsonrpc":"2.0","id":{draw(_BIG)},"method":"ping"}}'.encode(), -32600, None
    if kind == "big_token":
        return (f'{{{head},"method":"tools/call","params":{{{call},"arguments":{{"n":1}},'
                f'"_meta":{{"progressToken":{draw(_BIG)}}}}}}}').encode(), -32602, rid
    depth = draw(st.integers(1, 900))  # far below the parser's limit, wherever its stack starts
    if kind == "deep_arg":
        return (f'{{{head},"method":"tools/call","params":{{{call},"arguments":{{"n":{_deep(depth)}}}}}}}'
                .encode(), -32602, rid)
    if kind == "deep_token":
        return (f'{{{head},"method":"tools/call","params":{{{call},"arguments":{{"n":1}},'
                f'"_meta":{{"progressToken":{_deep(depth)}}}}}}}').encode(), -32602, rid
    if kind == "deep_env":
        return (f'{{{head},"method":"tools/call","params":{{{call},"arguments":{{"n":1}},'
                f'"env":{{"PI_SEARXNG_URL":{_deep(depth)}}}}}}}').encode(), -32602, rid
    if kind == "dup_top":
        key = draw(st.sampled_from(['"id":1', '"method":"ping"', '"jsonrpc":"2.0"', '"params":{}']))
        return f'{{{head},"method":"ping","params":{{}},{key}}}'.encode(), -32600, None
    # A key twice somewhere inside: in params, arguments, env, _meta, or deep in a value.
    inner = draw(st.sampled_from([
        f'"params":{{{call},"arguments":{{"n":1,"n":2}}}}',
        f'"params":{{{call},"name":"hello","arguments":{{"n":1}}}}',
        f'"params":{{{call},"arguments":{{"n":1}},"env":{{"PI_SEARXNG_URL":"a","PI_SEARXNG_URL":"b"}}}}',
        f'"params":{{{call},"arguments":{{"n":1}},"_meta":{{"progressToken":"a","progressToken":"b"}}}}',
        f'"params":{{{call},"arguments":{{"n":{_deep(depth, chr(123) + chr(34) + "k" + chr(34) + ":1," + chr(34) + "k" + chr(34) + ":2" + chr(125))}}}}}',
    ]))
    return f'{{{head},"method":"tools/call",{inner}}}'.encode(), -32600, None


lines = st.lists(st.one_of(messages(), notifications, garbage, hostile_requests().map(lambda case: case[0])),
                 min_size=1, max_size=12)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- properties ---------------------------------------------------------------------------


@FUZZ
@given(batch=lines, split=st.lists(st.integers(1, 64), max_size=8))
def test_every_line_gets_the_answers_json_rpc_promises(served: ThreadedServer, batch: list[bytes], split: list[int]) -> None:
    payload = b"\n".join(batch) + b"\n"
    expected_ids: collections.Counter[str] = collections.Counter()
    expected = 0
    for line in batch:
        count, request_id = expected_answer(line)
        expected += count
        if count:
            expected_ids[json.dumps(request_id)] += 1
    with served.connect() as sock:
        # Arbitrary write boundaries: framing must not depend on them.
        offset = 0
        for size in split:
            sock.sendall(payload[offset:offset + size])
            offset += size
        sock.sendall(payload[offset:])
        sock.sendall(b'{"jsonrpc":"2.0","id":"__sentinel__","method":"ping"}\n')
        answers = Reader(sock).answered("__sentinel__", expected)
    got_ids = collections.Counter(json.dumps(a.get("id")) for a in answers)
    # Equal numbers of answers per id (floats such as 1.0 are compared as JSON numbers).
    assert _normalise(got_ids) == _normalise(expected_ids), (batch, answers)


def _normalise(counter: collections.Counter[str]) -> collections.Counter[Any]:
    out: collections.Counter[Any] = collections.Counter()
    for key, count in counter.items():
        value = json.loads(key)
        out[json.dumps(value) if not isinstance(value, (int, float)) or isinstance(value, bool) else float(value)] += count
    return out


@FUZZ
@given(cases=st.lists(hostile_requests(), min_size=1, max_size=8))
def test_hostile_request_shapes_get_a_clear_code(served: ThreadedServer, cases: list[tuple[bytes, int, Any]]) -> None:
    with served.connect() as sock:
        reader = Reader(sock)
        for line, code, request_id in cases:
            sock.sendall(line + b"\n" + b'{"jsonrpc":"2.0","id":"__sentinel__","method":"ping"}\n')
            answers = reader.answered("__sentinel__", 1)  # a call may answer after the ping
            assert [(a.get("id"), a.get("error", {}).get("code")) for a in answers] == [(request_id, code)], (line[:200], answers)


@FUZZ
@given(noise=st.binary(max_size=3000))
def test_random_bytes_never_break_the_connection(served: ThreadedServer, noise: bytes) -> None:
    with served.connect() as sock:
        sock.sendall(noise)
        # End whatever line the noise left open, then prove the connection still works.
        sock.sendall(b'\n{"jsonrpc":"2.0","id":"__sentinel__","method":"ping"}\n')
        answers = Reader(sock).until("__sentinel__")
    assert answers[-1] == {"jsonrpc": "2.0", "id": "__sentinel__", "result": {}}


@FUZZ
@given(count=st.integers(1, 12), cancels=st.lists(st.integers(0, 15), max_size=200), reuse=st.booleans())
def test_cancel_storms_and_reused_ids_answer_each_call_once(served: ThreadedServer, count: int, cancels: list[int], reuse: bool) -> None:
    call = {"user": USER, "name": "hello", "arguments": {"name": "x"}}
    with served.connect() as sock:
        out = []
        for i in range(count):
            out.append({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": call})
            if reuse:  # the same id again while the first is (likely) in flight
                out.append({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": call})
        out += [{"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": c, "reason": "storm"}} for c in cancels]
        sock.sendall(b"".join(json.dumps(m).encode() + b"\n" for m in out))
        sock.sendall(b'{"jsonrpc":"2.0","id":"__sentinel__","method":"ping"}\n')
        expected = count * (2 if reuse else 1)
        answers = Reader(sock).answered("__sentinel__", expected)
    by_id = collections.defaultdict(list)
    for answer in answers:
        by_id[answer["id"]].append(answer)
    assert sorted(by_id) == list(range(count))
    for request_id, got in by_id.items():
        results = [a["result"] for a in got if "result" in a]
        errors = [a["error"] for a in got if "error" in a]
        assert len(results) >= 1, got  # every call is answered with a result...
        assert len(got) == (2 if reuse else 1), got  # ...and every line exactly once
        for error in errors:  # a reuse answers -32602 when the first is still in flight
            assert error["code"] == -32602 and "already used" in error["message"]
        for result in results:
            assert result["status"] in ("ok", "cancelled"), result


def test_a_thousand_connections_opened_and_dropped(served: ThreadedServer) -> None:
    call = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"user": USER, "name": "hello", "arguments": {"name": "x"}}}).encode() + b"\n"
    for i in range(1000):
        sock = served.connect()
        if i % 3 == 1:
            sock.sendall(b'{"jsonrpc":"2.0","id":1,"meth')  # half a line
        elif i % 3 == 2:
            sock.sendall(call)  # a call in flight, abandoned
        sock.close()
    with served.connect() as sock:
        reader = Reader(sock)
        deadline = time.monotonic() + 5
        while True:
            sock.sendall(b'{"jsonrpc":"2.0","id":"__sentinel__","method":"sandbox/status"}\n')
            status = reader.until("__sentinel__")[-1]["result"]
            if (status["connections"] == 1 and not status["callsInFlight"]) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert status["connections"] == 1 and status["callsInFlight"] == 0, status


def test_a_cancel_in_the_same_write_as_its_call_is_answered(served: ThreadedServer) -> None:
    """The cancel lands before the call's task ever ran: it must still answer `cancelled`, once."""
    call = {"jsonrpc": "2.0", "id": "c1", "method": "tools/call", "params": {"user": USER, "name": "hello", "arguments": {"name": "x"}}}
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "c1"}}
    with served.connect() as sock:
        sock.sendall(json.dumps(call).encode() + b"\n" + json.dumps(cancel).encode() + b"\n")
        sock.sendall(b'{"jsonrpc":"2.0","id":"__sentinel__","method":"ping"}\n')
        answers = Reader(sock).answered("__sentinel__", 1)
    assert [a["id"] for a in answers] == ["c1"]
    assert answers[0]["result"]["status"] == "cancelled"


@pytest.mark.parametrize("text", [b"NaN", b"[Infinity]", b'{"a":-Infinity}', b"1e400", b"-1e999", b'"\xed\xa0\x80"', b'"\xff"'])
def test_strict_json_refuses_what_json_does_not_have(text: bytes) -> None:
    with pytest.raises(ValueError):  # UnicodeDecodeError is a ValueError too
        strictjson.loads(text)


def test_strict_json_reads_json() -> None:
    assert strictjson.loads(b'{"a":[1,2.5,-0.0,1e300,"\\ud800",null,true]}') == {"a": [1, 2.5, -0.0, 1e300, "\ud800", None, True]}
