"""JSON-RPC messages have one place (sandboxd/wire.py, issue 45): their shapes, builders and readers.

A message built by hand elsewhere names its fields a second time, and a router that rewrites
ids would have to know every such place. So a scan fails on any wire dict built outside the
module; ``python -m tests.unit.test_wire`` prints the count. The builders' bytes are pinned
to what the hand-built dicts wrote, so clients read the same lines as before.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from sandboxd import wire

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sandboxd"
WIRE_MODULE = PACKAGE / "wire.py"

# Keys that make a dict a JSON-RPC message or a part only the wire module builds.
ENVELOPE_KEYS = {"jsonrpc"}
PART_KEY_SETS = ({"id", "result"}, {"id", "error"}, {"code", "message"},  # an answer, an error object
                 {"requestId"}, {"progressToken"})  # the params of notifications/cancelled and /progress


def _literal_keys(node: ast.AST) -> set[str] | None:
    """The constant keys a dict display, a dict(...) call or a subscript store names; None for other nodes."""
    if isinstance(node, ast.Dict):
        return {key.value for key in node.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return {keyword.arg for keyword in node.keywords if keyword.arg is not None}
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
        return {node.slice.value} if isinstance(node.slice.value, str) else None
    return None


def _is_wire_shape(keys: set[str]) -> bool:
    return bool(keys & ENVELOPE_KEYS) or any(part <= keys for part in PART_KEY_SETS)


def wire_dicts_outside_the_wire_module() -> list[str]:
    """Every place under sandboxd/ but wire.py that builds a wire dict, as path:line."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == WIRE_MODULE or "__pycache__" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            keys = _literal_keys(node)
            if keys and _is_wire_shape(keys):
                found.add(f"{path.relative_to(ROOT).as_posix()}:{getattr(node, 'lineno', '?')}")
    return sorted(found)


def test_no_wire_dict_is_built_outside_the_wire_module() -> None:
    found = wire_dicts_outside_the_wire_module()
    assert not found, ("JSON-RPC messages built by hand outside sandboxd/wire.py; use its builders "
                       "(request, notification, response, error_response, ...):\n  " + "\n  ".join(found))


def test_the_scan_sees_each_way_of_building_one(tmp_path: Path) -> None:
    shapes = ['{"jsonrpc": "2.0", "method": "m"}', 'dict(jsonrpc="2.0", id=1, result={})', '{"id": 1, "result": {}}',
              '{"code": -32600, "message": "no"}', '{"requestId": 1, "reason": "r"}']
    for shape in shapes:
        keys = _literal_keys(ast.parse(shape, mode="eval").body)
        assert keys and _is_wire_shape(keys), shape
    store = ast.parse('message["jsonrpc"] = "2.0"').body[0]
    assert isinstance(store, ast.Assign) and _is_wire_shape(_literal_keys(store.targets[0]) or set())
    for other in ['{"error": "not JSON-RPC"}', '{"id": 1, "name": "x"}', 'dict(a=1)', '{"message": "m"}']:
        assert not _is_wire_shape(_literal_keys(ast.parse(other, mode="eval").body) or set()), other


# -- the builders write the bytes the hand-built dicts wrote --------------------------------------


@pytest.mark.parametrize(("message", "line"), [
    (wire.request(7, "call", {"tool": "hello"}), b'{"jsonrpc":"2.0","id":7,"method":"call","params":{"tool":"hello"}}'),
    (wire.request("a", "sandbox/status"), b'{"jsonrpc":"2.0","id":"a","method":"sandbox/status"}'),
    (wire.notification("shutdown"), b'{"jsonrpc":"2.0","method":"shutdown"}'),
    (wire.notification("cancel", {"id": 3, "reason": "r"}), b'{"jsonrpc":"2.0","method":"cancel","params":{"id":3,"reason":"r"}}'),
    (wire.notification(wire.TOOLS_LIST_CHANGED, {}), b'{"jsonrpc":"2.0","method":"notifications/tools/list_changed","params":{}}'),
    (wire.response(1.5, {"content": []}), b'{"jsonrpc":"2.0","id":1.5,"result":{"content":[]}}'),
    (wire.error_response(None, wire.error_object(-32600, "no")), b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"no"}}'),
    (wire.error_response(2, wire.error_object(-32602, "bad", {"argument": "x"})),
     b'{"jsonrpc":"2.0","id":2,"error":{"code":-32602,"message":"bad","data":{"argument":"x"}}}'),
    (wire.cancelled(4, "cancelled by the user"),
     b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":4,"reason":"cancelled by the user"}}'),
    (wire.progress("t", 2, [{"type": "text", "text": "hi"}]),
     b'{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":"t","progress":2,'
     b'"content":[{"type":"text","text":"hi"}]}}'),
])
def test_each_builder_writes_the_line_clients_have_always_read(message: wire.Message, line: bytes) -> None:
    assert wire.encode(message) == line + b"\n"


def test_a_malformed_line_is_answered_with_its_code_and_its_usable_id() -> None:
    for line, code, request_id in [(b"{", wire.PARSE_ERROR, None), (b"[]", wire.INVALID_REQUEST, None),
                                   (b'{"id":5,"method":1}', wire.INVALID_REQUEST, 5),
                                   (b'{"jsonrpc":"2.0","id":1e400,"method":"m"}', wire.PARSE_ERROR, None),
                                   (b'{"jsonrpc":"2.0","id":1,"id":2,"method":"m"}', wire.INVALID_REQUEST, None)]:
        with pytest.raises(wire.Malformed) as refused:
            wire.parse_request(line)
        answer = refused.value.answer()
        assert (answer["error"]["code"], answer["id"]) == (code, request_id), line
    assert wire.parse_request(b'{"jsonrpc":"2.0","id":"x","method":"m","params":[1]}') == ("x", "m", [1], True)
    assert wire.parse_request(b'{"jsonrpc":"2.0","method":"m"}') == (None, "m", None, False)


def test_an_error_answer_reads_back_as_the_rpc_error_it_stands_for() -> None:
    error = wire.RpcError.from_error(wire.error_object(-32004, "over quota", {"biggest": []}))
    assert (error.code, error.message, error.data, str(error)) == (-32004, "over quota", {"biggest": []}, "over quota")


def test_a_router_can_tell_messages_apart_and_rewrite_their_ids() -> None:
    messages = [wire.request(1, "m"), wire.notification("n"), wire.response(1, {}),
                wire.error_response(1, wire.error_object(-1, "e")), {"jsonrpc": "2.0"}]
    assert [wire.kind(dict(message)) for message in messages] == ["request", "notification", "response", "error", "unknown"]
    request = wire.request(1, "tools/call", {"name": "t"})
    rewritten = wire.with_id(request, "up-1")
    assert wire.encode(rewritten) == wire.encode(request).replace(b'"id":1', b'"id":"up-1"')
    assert request["id"] == 1  # the original is left as it was
    assert json.loads(wire.encode(wire.with_id(wire.response(9, {"ok": True}), 1))) == wire.response(1, {"ok": True})


if __name__ == "__main__":
    print(f"wire-dict builders outside sandboxd/wire.py: {len(wire_dicts_outside_the_wire_module())}")
