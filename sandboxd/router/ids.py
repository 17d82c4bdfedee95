"""One upstream connection's requests in flight, under ids of its own (httpcore's shape: no I/O here).

Clients choose their ids freely, so two clients' ``1`` would meet on a shared upstream
connection. The router gives every request it sends up a fresh id of that connection,
and the progress token with it (the host names a call's progress by its token, which two
clients may also share). ``received`` reads one message from the host and says what to do
with it; the caller does the I/O. ``close`` frees a slot whatever became of its caller, so
a cancelled caller never leaks one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple

from sandboxd.wire import PROGRESS, is_request_id, with_meta_progress_token, with_progress_token

OnProgress = Callable[[dict[str, Any]], None]  # a notifications/progress's params, token already the client's

_ANSWER_HEAD = b'{"jsonrpc":"2.0","id":'  # a host's answers as wire.response writes them: these keys, in this order
_RESULT = b'"result":'


class Verbatim(NamedTuple):
    """A host's success answer, its result still the JSON the host wrote: the router passes it on unparsed."""

    result: bytes


def verbatim_answer(line: bytes) -> tuple[int, bytes] | None:
    """(id, the result's JSON) of a host's success answer line, read without parsing the result; None for any
    other line (an error, a notification), which is parsed whole."""
    if not line.startswith(_ANSWER_HEAD) or not line.endswith(b"}"):
        return None
    comma = line.find(b",", len(_ANSWER_HEAD))
    digits = line[len(_ANSWER_HEAD):comma]
    if comma < 0 or not digits.isdigit() or not line.startswith(_RESULT, comma + 1):
        return None
    return int(digits), line[comma + 1 + len(_RESULT):-1]


@dataclass
class Slot:
    """A request sent up: what its progress goes to, and its answer once it came (``outcome``)."""

    on_progress: OnProgress | None = None
    client_token: Any = None  # the client's progress token (its own, or its request id when it gave none)
    verbatim: bool = False  # a success answer may settle it unparsed (``Verbatim``): the client gets the bytes
    waiter: Any = field(default=None, repr=False)  # what the caller awaits (a future): the I/O side's, never read here
    outcome: dict[str, Any] | None = field(default=None, repr=False)


class Step(NamedTuple):
    """What to do with a message from the host."""

    action: Literal["answer", "progress", "notify", "drop"]
    slot: Slot | None
    message: dict[str, Any]


class UpstreamIds:
    def __init__(self) -> None:
        self._next = 1
        self.slots: dict[int, Slot] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def open(self, slot: Slot) -> int:
        """A fresh id for ``slot``, held until ``close``."""
        upstream_id, self._next = self._next, self._next + 1
        self.slots[upstream_id] = slot
        return upstream_id

    def close(self, upstream_id: int) -> Slot | None:
        return self.slots.pop(upstream_id, None)

    def lost(self) -> list[Slot]:
        """The connection died: every slot, emptied (their callers are told)."""
        slots, self.slots = list(self.slots.values()), {}
        return slots

    def received(self, message: dict[str, Any]) -> Step:
        method = message.get("method")
        if isinstance(method, str):
            if method == PROGRESS:
                return self._progress(message)
            return Step("notify", None, message)
        upstream_id = message.get("id")
        slot = self.slots.pop(upstream_id, None) if isinstance(upstream_id, int) else None
        if slot is None:
            return Step("drop", None, message)  # an answer to a slot closed meanwhile (its caller left)
        slot.outcome = message
        return Step("answer", slot, message)

    def take_verbatim(self, upstream_id: int) -> Slot | None:
        """The slot an unparsed answer to ``upstream_id`` settles, taken out; None when it asked for a parsed one
        (or was closed meanwhile): the answer is then read whole."""
        slot = self.slots.get(upstream_id)
        return self.slots.pop(upstream_id) if slot is not None and slot.verbatim else None

    def _progress(self, message: dict[str, Any]) -> Step:
        params = message.get("params")
        token = params.get("progressToken") if isinstance(params, dict) else None
        slot = self.slots.get(token) if isinstance(token, int) else None
        if slot is None or slot.on_progress is None or not isinstance(params, dict):
            return Step("drop", None, message)
        return Step("progress", slot, with_progress_token(params, slot.client_token))


def with_token(params: dict[str, Any], upstream_id: int) -> dict[str, Any] | None:
    """``params`` with its progress token replaced by ``upstream_id``; None when the client's token is not
    one the host would accept (it is sent as it came, so the host refuses it as it would directly)."""
    meta = params.get("_meta")
    if meta is None:
        return with_meta_progress_token(params, {}, upstream_id)
    if not isinstance(meta, dict):
        return None
    token = meta.get("progressToken")
    if token is not None and not is_request_id(token):
        return None
    return with_meta_progress_token(params, meta, upstream_id)


def client_token(params: dict[str, Any], client_id: Any) -> Any:
    """The token the client reads its progress by: its own, or its request id when it gave none."""
    meta = params.get("_meta")
    token = meta.get("progressToken") if isinstance(meta, dict) else None
    return client_id if token is None else token
