"""A request on its way to its user's host: routed by the view, sent once, retried only after a refusal.

A host's -32005 refusal (``elsewhere``, ``moving``) is given before the call starts, so it
is the one answer after which the call may be sent again: ``elsewhere`` (the router's view
was stale) once, at the host it names; ``moving`` after the view changes, until the call's
own deadline. Any other end (an answer, a connection that died mid-call) goes to the client
as it is: a call a host may have started is never sent twice.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from sandboxd.errors import BackendUnavailable, SandboxdError
from sandboxd.router.ids import OnProgress, Verbatim
from sandboxd.router.routing import Directory, decide, moving, refusal_of
from sandboxd.router.upstream import Dial, Lost, Notify, Upstream, UpstreamConnection

MOVING_POLL_S = 0.25  # how often a call waiting for a move looks at the view again (a change wakes it sooner)


class Answered(SandboxdError):
    """A host's error answer, passed to the client as it came (code, message, data)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(str(error.get("message", "")), error.get("data"))
        self.code = error.get("code", -32603)


class HostSilent(BackendUnavailable):
    """The host kept a call past its deadline and the grace: cancelled there, answered here."""


class NotSent(Exception):
    """The client cancelled the request before it reached a host: nothing ran."""


class Forward:
    """One forwarded request, as the dispatcher sees it (``InFlight``): a cancel follows it to its host."""

    def __init__(self) -> None:
        self.reason: str | None = None  # cancelled, and why
        self.stopped = asyncio.Event()
        self._at: tuple[UpstreamConnection, int] | None = None
        self.last: UpstreamConnection | None = None  # where it was sent last (a watch is held there)

    def sent(self, conn: UpstreamConnection, upstream_id: int) -> None:
        self._at = (conn, upstream_id)
        self.last = conn

    def returned(self) -> None:
        self._at = None

    def cancel(self, reason: str) -> None:
        self.reason = reason
        self.stopped.set()
        if self._at is not None:
            conn, upstream_id = self._at
            conn.cancel(upstream_id, reason)

    def pause(self) -> None:
        """The host's connection is shared: one client's back-pressure cannot pause it (its answers wait here)."""

    def resume(self) -> None: ...


class Hosts:
    """The upstreams by node, made as the directory names them."""

    def __init__(self, dial: Dial, on_notification: Notify, on_lost: Lost) -> None:
        self._dial, self._on_notification, self._on_lost = dial, on_notification, on_lost
        self.by_node: dict[str, Upstream] = {}

    def get(self, node: str, address: str) -> Upstream:
        upstream = self.by_node.get(node)
        if upstream is None or upstream.address != address:
            if upstream is not None:
                upstream.close()  # the host came back at another address: its old connections lead nowhere
            upstream = self.by_node[node] = Upstream(node, address, self._dial, self._on_notification,
                                                           self._on_lost)
        return upstream

    def close(self) -> None:
        for upstream in self.by_node.values():
            upstream.close()


class Sending:
    """What one request carries to whichever host it reaches."""

    def __init__(self, method: str, params: Any, *, deadline_s: float, wait_s: float | None,
                 on_progress: OnProgress | None = None, client_token: Any = None,
                 rewrite: Callable[[Any, int], Any] | None = None, forward: Forward | None = None,
                 to_watch: bool = False, verbatim: bool = False) -> None:
        self.method, self.params = method, params
        self.deadline = time.monotonic() + deadline_s  # how long a move is waited for
        self.wait_s = wait_s  # how long the host may take to answer, once sent
        self.on_progress, self.client_token, self.rewrite = on_progress, client_token, rewrite
        self.forward = forward or Forward()
        self.to_watch = to_watch  # on a connection that may watch one more user
        self.verbatim = verbatim  # a success answer's result passed on unparsed (``Verbatim``)


async def routed(user: str, sending: Sending, view: Directory, hosts: Hosts) -> dict[str, Any] | Verbatim:
    """The host's answer for ``user``'s request (a -32005 refusal the router could not get past included)."""
    elsewhere_tried = False
    while True:
        decision = decide(user, view)
        if decision.action == "refuse":
            assert decision.refusal is not None
            raise decision.refusal
        assert decision.node is not None
        if decision.action == "place":
            await view.claim(user, decision.node)  # a lost race: the winner's home is in the view afterwards
            continue
        if decision.action == "wait":
            await wait_for_move(user, decision.node, sending, view)
            continue
        assert decision.address is not None
        answer = await send(hosts.get(decision.node, decision.address), sending)
        refusal = None if isinstance(answer, Verbatim) else refusal_of(answer)
        if refusal is not None and refusal[0] == "elsewhere" and not elsewhere_tried:
            elsewhere_tried = True  # the view is stale: once, at the host that says it holds the user
            node, address = refusal[1].get("node"), refusal[1].get("address")
            if isinstance(node, str) and isinstance(address, str):
                answer = await send(hosts.get(node, address), sending)
                refusal = None if isinstance(answer, Verbatim) else refusal_of(answer)
        if refusal is None or refusal[0] != "moving":
            return answer
        await wait_for_move(user, str(refusal[1].get("node") or decision.node), sending, view)


async def send(upstream: Upstream, sending: Sending) -> dict[str, Any] | Verbatim:
    forward = sending.forward
    if forward.reason is not None:
        raise NotSent(forward.reason)
    try:
        on = await upstream.connection(to_watch=True) if sending.to_watch else None
        return await upstream.call(sending.method, sending.params, on_progress=sending.on_progress,
                                   client_token=sending.client_token, rewrite=sending.rewrite, sent=forward.sent,
                                   timeout_s=sending.wait_s, on=on, verbatim=sending.verbatim)
    except asyncio.TimeoutError:
        raise HostSilent(f"host {upstream.node} did not answer within {sending.wait_s:g} s (the call's deadline and "
                         "its grace); the call was cancelled there. Check the host, then call again.") from None
    finally:
        forward.returned()


async def wait_for_move(user: str, node: str, sending: Sending, view: Directory) -> None:
    """Until the view changes (or a moment passes); ``moving`` once the call's deadline is past."""
    remaining = sending.deadline - time.monotonic()
    if remaining <= 0:
        raise moving(user, node)
    stopped = sending.forward.stopped
    waits = [asyncio.ensure_future(view.changed(min(remaining, MOVING_POLL_S))), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
    if sending.forward.reason is not None:
        raise NotSent(sending.forward.reason)
