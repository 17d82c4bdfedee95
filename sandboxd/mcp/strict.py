"""One test both transports of `sandboxd mcp` put every message through before the SDK reads it.

The SDK's JSON parsers keep the last of a key given twice, others keep the first: a message
``{"name": "safe_tool", "name": "evil"}`` reads as one tool to a proxy or a log in front
and as another here. So such a message is refused, never guessed, as the daemon refuses it
(sandboxd.strictjson, the same parser, docs/protocol.md).
"""

from __future__ import annotations

import json

from sandboxd import strictjson
from sandboxd.wire import INVALID_REQUEST, ErrorResponse, error_object, error_response


def duplicate_key_error(data: bytes) -> ErrorResponse | None:
    """The JSON-RPC error answering ``data`` when an object in it holds a key twice, else None.

    Anything else that is wrong with ``data`` is left to the SDK's parser to answer.
    """
    try:
        strictjson.loads(data, unique_keys=True)
    except strictjson.DuplicateKey as exc:
        return error_response(_lone_id(data), error_object(
            INVALID_REQUEST, f"{exc}; send every key of an object once. The message was not run."))
    except (ValueError, RecursionError):
        pass
    return None


def _lone_id(data: bytes) -> str | int | None:
    """The message's id when it has exactly one usable one, so the client can match the error to its request."""
    try:
        pairs = json.loads(data, object_pairs_hook=lambda pairs: pairs)
    except (ValueError, RecursionError):
        return None
    ids = [value for key, value in pairs if key == "id"] if isinstance(pairs, list) and all(
        isinstance(pair, tuple) for pair in pairs) else []
    if len(ids) == 1 and isinstance(ids[0], (str, int)) and not isinstance(ids[0], bool):
        return ids[0]
    return None
